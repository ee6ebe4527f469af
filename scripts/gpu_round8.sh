#!/usr/bin/env bash
# Device call (nvidia-h200-x2) after overlapped steps + fused router + MLA split rule: the GPU tests of those,
# `afd bench step` (one H200) and `afd bench` 1A1F (both connectors), then the graphed step's profile at batch 8
# and 256. At most 8 files come back.
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$SECONDS
timeout 200 python3 -m pytest -q -m gpu tests/test_engine_overlap.py tests/test_cuda_graph.py tests/test_kv_cache.py \
  tests/test_kernel_mla_decode.py -p no:cacheprovider -s 2>&1 | grep -E "passed|failed|Error|error|gap|FAIL" | tail -n 12
echo "gpu tests in $((SECONDS - t0)) s"
t0=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 260 python3 -m afd bench step --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --batch 1,8,64,256 --context 512 --prefill 8x1024 --json "$OUT/bench_step.json" 2>"$OUT/bench_step.err" | tail -n 14
echo "bench step rc=$? in $((SECONDS - t0)) s"; tail -n 2 "$OUT/bench_step.err"
t0=$SECONDS
timeout 150 python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 1 --ffn 1 \
  --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64 --json "$OUT/lite_bf16_1a1f.json" 2>/dev/null | tail -n 7
echo "afd bench 1a1f rc=$? in $((SECONDS - t0)) s"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/gpu_step_profile.py --batch 8,256 >"$OUT/profile.txt" 2>&1
echo "profile rc=$?"; grep -E "^===|Self CUDA time total|Self CPU time total" "$OUT/profile.txt" | head -n 12
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
