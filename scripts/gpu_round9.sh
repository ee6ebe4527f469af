#!/usr/bin/env bash
# Device call (nvidia-h200-x2): `afd bench step` with the steady state timed between CUDA events, the front end's
# TTFT overhead (`afd bench serve --overhead`, issue 12) and the `mixed` serving table rerun with the device-side
# waits of the async connector. At most 8 files come back.
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m afd bench step --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --batch 1,8,64,256 --context 512 --prefill 8x1024 --json "$OUT/bench_step.json" 2>"$OUT/bench_step.err" | tail -n 12
echo "bench step rc=$? in $((SECONDS - t0)) s"; grep -i warn "$OUT/bench_step.err" | head -n 3
t0=$SECONDS
timeout 150 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 40 --json "$OUT/overhead.json" \
  2>"$OUT/overhead.err" | tail -n 12
echo "overhead rc=$? in $((SECONDS - t0)) s"; tail -n 2 "$OUT/overhead.err"
t0=$SECONDS
timeout 280 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 48 --rates 4,16,64 \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed.json" 2>"$OUT/serve_mixed.err" | tail -n 16
echo "bench serve rc=$? in $((SECONDS - t0)) s"; tail -n 3 "$OUT/serve_mixed.err"
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
