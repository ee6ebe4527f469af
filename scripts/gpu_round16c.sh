#!/usr/bin/env bash
# Round 16c (nvidia-h200-x2, under 10 minutes): the prefill graphs' GPU tests with their failure output; with prefill
# graphs on, V2-Lite bf16 at 1A1F: the decode row (64 x 512, 32 new) and chunked prefill (64 x 512 in 2,048-token
# steps, timeline) for async, async+sa and p2p; serving the mixed workload (none R=2, p2p, async+sa). `afd generate`'s
# logs say whether prefill graphs were captured.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r16c
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_prefill_graph.py 2>&1 \
  | tail -n 60 > "$OUT/gpu_tests.txt"; tail -n 3 "$OUT/gpu_tests.txt"
timeout 120 python3 -m afd -v generate "${ORACLE[@]}" >"$B/ref.json" 2>"$B/ref.err"; echo "ref rc=$?"
grep -c "captured the prefill CUDA graphs" "$B/ref.err"; grep -iE "failed|Error" "$B/ref.err" | head -5
bench decode_b64 110 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32 \
  --shared-experts ffn,attention --connectors async,p2p --no-score
export AFD_TIMELINE=$B/chunked.tl
bench chunked 110 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 1 --no-score \
  --shared-experts ffn,attention --connectors async,p2p
python3 -m afd.profiling.timeline_report "$AFD_TIMELINE" --json "$OUT/chunked_timeline.json" | grep -E "^[a-z]|host|step |round"
unset AFD_TIMELINE
serve_mixed serve_mixed_1a1f_sa 240 --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --requests 64 --rates 64,inf \
  --warmups 8 --config '{"connector": "async", "connector_extra_config": {"shared_experts_on_attention": true}}'
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
