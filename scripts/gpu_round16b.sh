#!/usr/bin/env bash
# Round 16b: prefill CUDA graphs (afd.engine.graphs.prefill), one call of under 10 minutes on nvidia-h200-x2: their GPU tests,
# where the attention host's time goes with and without them (one GPU, scripts/host_profile.py), the fp32 oracle on
# CUDA with them (none, async 1A1F with and without micro-batches and the shared experts on attention, p2p 1A1F and
# 2A2F), then V2-Lite bf16: 1A1F prefill of 8 x 1024 with them on and off (1 and 2 micro-batches), and chunked
# prefill (64 x 512 in 2,048-token steps) for async+sa and p2p with the attention host's timeline.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r16b
timeout 240 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_prefill_graph.py tests/test_cuda_graph.py \
  2>&1 | tail -n 4
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 scripts/host_profile.py "$OUT" 2>"$B/host_profile.err"
echo "host_profile rc=$?"; tail -n 3 "$B/host_profile.err"
SA='{"connector_extra_config": {"shared_experts_on_attention": true}}'
SA_M2='{"connector_extra_config": {"shared_experts_on_attention": true, "async_moe_ubatching": true}}'
export GEN_DIR=$B
AFD_PREFILL_GRAPHS=0 gen ref_eager "${ORACLE[@]}"
gen ref "${ORACLE[@]}"
gen async_1a1f_sa "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --config "$SA"
gen async_1a1f_sa_m2 "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --config "$SA_M2"
gen p2p_1a1f "${ORACLE[@]}" --connector p2p --attention 1 --ffn 1
gen p2p_2a2f "${ORACLE[@]}" --connector p2p --attention 2 --ffn 2
python3 scripts/compare_outputs.py "$B/ref_eager.json" "$B"/ref.json "$B"/async_1a1f_sa.json "$B"/async_1a1f_sa_m2.json \
  "$B"/p2p_1a1f.json "$B"/p2p_2a2f.json | tee "$OUT/compare.txt"
PREFILL=(--attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 --ubatches 1,2
  --shared-experts attention --repeat 3 --connectors async,p2p --max-num-batched-tokens 8192 --no-score)
bench prefill_graphs 200 "${PREFILL[@]}"
AFD_PREFILL_GRAPHS=0 bench prefill_eager 200 "${PREFILL[@]}"
export AFD_TIMELINE=$B/chunked.tl
bench chunked 120 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 1 --no-score \
  --shared-experts attention --connectors async,p2p
python3 -m afd.profiling.timeline_report "$AFD_TIMELINE" --json "$OUT/chunked_timeline.json" | grep -E "^[a-z]|host|step |round"
unset AFD_TIMELINE
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
