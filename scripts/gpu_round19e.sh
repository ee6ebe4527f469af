#!/usr/bin/env bash
# Round 19e (one H200): as round 19d, after the stream's headers go out at once (off the first token's path), busy
# polling on, twice; then `--overhead` (the same requests straight into one replica engine, in-process) with
# busy polling on.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19e
export CUDA_VISIBLE_DEVICES=0
AFD_BUSY_POLL=1 front_end front_end_bp1_headers
AFD_BUSY_POLL=1 front_end front_end_bp1_headers_again
AFD_BUSY_POLL=1 timeout 200 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --warmups 4 \
  --json "$OUT/overhead_bp1.json" 2>"$B/overhead.err" | tail -n 4
echo "overhead rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/overhead.err" | grep -iv warn | tail -n 2
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
