#!/usr/bin/env bash
# Round 15: the shared experts on the attention rank (`connector_extra_config.shared_experts_on_attention`), one call
# of under 10 minutes on nvidia-h200-x2: the fp32 oracle on CUDA with it on (1A1F eager and captured decode steps,
# micro-batches, 2A2F), then V2-Lite bf16: 1A1F prefill of 8 x 1024 with and without it and with 1 and 2
# micro-batches (3 launches each, p2p beside), its per-layer timeline, the 1A1F decode step, and bf16 numerics.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r15
SA='{"connector_extra_config": {"shared_experts_on_attention": true}}'
SA_M2='{"connector_extra_config": {"shared_experts_on_attention": true, "async_moe_ubatching": true}}'
gen ref "${ORACLE[@]}"
gen async_1a1f_sa "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --config "$SA"
gen async_1a1f_sa_m2 "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --config "$SA_M2"
gen async_2a2f_sa "${ORACLE[@]}" --connector async --attention 2 --ffn 2 --config "$SA"
python3 scripts/compare_outputs.py "$OUT/ref.json" "$OUT"/async_1a1f_sa.json "$OUT"/async_1a1f_sa_m2.json \
  "$OUT"/async_2a2f_sa.json | tee "$OUT/compare.txt"
bench 1a1f_prefill_8x1024_shared 300 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2 --shared-experts ffn,attention --repeat 3 --connectors async,p2p \
  --max-num-batched-tokens 8192 --no-score
timelined 1a1f_prefill_8x1024_sa 60 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --shared-experts attention --connectors async --max-num-batched-tokens 8192 --no-score
bench 1a1f_decode_b64_shared 100 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 \
  --max-new-tokens 32 --shared-experts ffn,attention --connectors async --no-score
bench 1a1f_numerics_sa 150 --attention 1 --ffn 1 --requests 8 --long-len 512 --short-len 512 --max-new-tokens 8 \
  --shared-experts attention --connectors async
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
