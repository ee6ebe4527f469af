#!/usr/bin/env bash
# Device call (nvidia-h200-x2) after CUDA graphs on async FFN ranks and the one-FFN-rank fast path: the graphs' GPU
# test, `afd bench` 1A1F (both connectors; numerics against the reference), `afd bench exchange` (async), the tiny
# CUDA evidence for async 1A1F / 2A2F, and the step's numerics against the eager engine (issue 10).
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 90 python3 -m pytest -q -m gpu tests/test_ffn_graphs.py -p no:cacheprovider 2>&1 | tail -n 3
t0=$SECONDS
timeout 130 python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 1 --ffn 1 \
  --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64 --json "$OUT/lite_bf16_1a1f.json" 2>"$OUT/bench.err" | tail -n 7
echo "afd bench 1a1f rc=$? in $((SECONDS - t0)) s"; grep -iE "error|graphs" "$OUT/bench.err" | head -n 3
timeout 45 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --connectors async \
  --json "$OUT/exchange.json" 2>/dev/null | tail -n 6
PROMPTS="5,17,33,2,9,41,7,3,19,23,11;4,8;100,3,77,12,9,250;1"
COMMON=(--model tiny --prompt-ids "$PROMPTS" --max-new-tokens 8 --prompt-logprobs --device cuda --json)
timeout 60 python3 -m afd generate "${COMMON[@]}" >"$OUT/ref.json" 2>/dev/null; echo "ref rc=$?"
timeout 60 python3 -m afd generate "${COMMON[@]}" --connector async --attention 1 --ffn 1 >/tmp/a1.json 2>/dev/null; echo "a1 rc=$?"
timeout 60 python3 -m afd generate "${COMMON[@]}" --connector async --attention 2 --ffn 2 >/tmp/a2.json 2>/dev/null; echo "a2 rc=$?"
python3 scripts/compare_outputs.py "$OUT/ref.json" /tmp/a1.json /tmp/a2.json
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 scripts/gpu_kernel_numerics.py >"$OUT/numerics.jsonl" 2>"$OUT/numerics.err"
echo "numerics rc=$?"; cat "$OUT/numerics.jsonl"; tail -n 2 "$OUT/numerics.err"
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
