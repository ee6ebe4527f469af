#!/usr/bin/env bash
# Round 19d (one H200): the front end's share of TTFT at 1 request/s, cut into stages, measured with the
# benchmark's own HTTP/1.1 client (`afd.bench.http1`; rounds 19b-c used aiohttp's, whose request path spent
# ~0.3 ms before the request's first byte left), busy polling on (twice) and off.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19d
export CUDA_VISIBLE_DEVICES=0
AFD_BUSY_POLL=1 front_end front_end_bp1_lean
AFD_BUSY_POLL=0 front_end front_end_bp0_lean
AFD_BUSY_POLL=1 front_end front_end_bp1_lean_again
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
