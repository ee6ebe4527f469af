#!/usr/bin/env bash
# Round 16e (nvidia-h200-x2, under 6 minutes): serving capacity of the mixed workload at 1A1F with 512 requests per
# server instead of 64 — round 16 c and d gave the same servers ±25% apart with 64 requests (about a second of load
# at capacity); prefill graphs on, async with the shared experts on its attention rank.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r16e
timeout 420 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 512 --rates inf --warmups 16 \
  --short-len 64 --long-len 1024 --max-tokens 64 \
  --config '{"connector": "async", "connector_extra_config": {"shared_experts_on_attention": true}}' \
  --json "$OUT/serve_mixed_1a1f_512.json" 2>"$B/serve.err" | tail -n 8
rc=${PIPESTATUS[0]}; echo "serve rc=$rc"; [[ $rc == 0 ]] || tail -n 30 "$B/serve.err" > "$OUT/serve.err"
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
