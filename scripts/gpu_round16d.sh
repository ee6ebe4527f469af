#!/usr/bin/env bash
# Round 16d (nvidia-h200-x2, under 6 minutes): the prefill graphs' GPU tests (fixed for a one-token prompt), then
# serving the mixed workload at 1A1F with prefill graphs off and on in one call (none R=2 and async+sa each):
# does padding mixed steps to token buckets cost serving anything?
set -u
source "$(dirname "$0")/device_env.sh"
log_run r16d
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_prefill_graph.py 2>&1 \
  | tail -n 40 > "$OUT/gpu_tests.txt"; tail -n 3 "$OUT/gpu_tests.txt"
for graphs in 0 1; do
  AFD_PREFILL_GRAPHS=$graphs timeout 170 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 \
    --device cuda --compare none:R=2,async:A=1,F=1 --workload mixed --requests 64 --rates inf --warmups 8 \
    --short-len 64 --long-len 1024 --max-tokens 64 \
    --config '{"connector": "async", "connector_extra_config": {"shared_experts_on_attention": true}}' \
    --json "$OUT/serve_mixed_graphs$graphs.json" 2>"$B/serve$graphs.err" | tail -n 6
  echo "serve graphs=$graphs rc=${PIPESTATUS[0]}"
done
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
