#!/usr/bin/env bash
# Round 15, call f: after the last cuts of host work (no multiply by a residual scale of 1, the top-k ids converted
# by the copy into the slot, no arange per one-FFN-rank plan): the fp32 oracle on CUDA for both connectors and both
# places of the shared experts, then 1A1F prefill of 8 x 1024 once per configuration.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r15f
SA='{"connector": "async", "connector_extra_config": {"shared_experts_on_attention": true}}'
M2='{"connector": "async", "connector_extra_config": {"async_moe_ubatching": true}}'
GEN_DIR=$B
gen ref "${ORACLE[@]}"
gen async_1a1f "${ORACLE[@]}" --connector async --attention 1 --ffn 1
gen async_1a1f_sa "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --config "$SA"
gen async_1a1f_m2 "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --config "$M2"
gen async_2a2f_sa "${ORACLE[@]}" --connector async --attention 2 --ffn 2 --config "$SA"
gen p2p_1a1f "${ORACLE[@]}" --connector p2p --attention 1 --ffn 1
python3 scripts/compare_outputs.py "$B/ref.json" "$B"/async_1a1f.json "$B"/async_1a1f_sa.json "$B"/async_1a1f_m2.json \
  "$B"/async_2a2f_sa.json "$B"/p2p_1a1f.json | tee "$OUT/compare.txt"
bench prefill 150 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 1,2 --shared-experts ffn,attention --connectors async,p2p --max-num-batched-tokens 8192 --no-score
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
