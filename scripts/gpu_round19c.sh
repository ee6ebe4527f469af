#!/usr/bin/env bash
# Round 19c (one H200; the x2 kind was not lent). Run as a fresh machine's first call (Triton's disk cache empty).
# 1. Triton kernels compiled while serving after round 19b's fixes: the MoE kernels at every routed variant
#    (`moe.warm_up_token_counts`) on a whole-model replica too, the prefill's key-length table always 16-byte
#    aligned. `none` R=1 serving the mixed workload with AFD_LOG_DIR, then the rank logs' compile lines.
# 2. The front end's share of TTFT at 1 request/s, cut into stages, with busy polling on: asyncio's loop against
#    uvloop (AFD_UVLOOP=0/1; the wheel is carried), and uvloop without busy polling.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19c
export CUDA_VISIBLE_DEVICES=0
cold_serving
python3 -c "import uvloop; print('uvloop', uvloop.__version__)"
AFD_BUSY_POLL=1 AFD_UVLOOP=0 front_end front_end_bp1_asyncio
AFD_BUSY_POLL=1 AFD_UVLOOP=1 front_end front_end_bp1_uvloop
AFD_BUSY_POLL=0 AFD_UVLOOP=1 front_end front_end_bp0_uvloop
AFD_BUSY_POLL=1 AFD_UVLOOP=0 front_end front_end_bp1_asyncio_again
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
