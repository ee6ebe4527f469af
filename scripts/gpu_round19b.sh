#!/usr/bin/env bash
# Round 19b (one H200; the x2 kind was not lent). Run as a fresh machine's first call (Triton's disk cache empty).
# 1. Which Triton kernels still compile while serving after the extended warm-up (decode kernels at every split
#    class, a continued prompt beside decodes): `none` R=1 serving the mixed workload with AFD_LOG_DIR, then the
#    rank logs' compile lines (round 19a: 4 MLA decode variants and 1 prefill variant compiled mid-run).
# 2. The front end's share of TTFT at 1 request/s, busy polling off and on, now cut into stages at the server's
#    stamps (`ttft_stages_p50_s`): where the 1.7-2.0 ms of round 19a go.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19b
export CUDA_VISIBLE_DEVICES=0
cold_serving
for bp in 0 1; do AFD_BUSY_POLL=$bp front_end front_end_busy_poll_$bp; done
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
