#!/usr/bin/env bash
# Issue 10 item 4 on one H200: every Triton kernel against its eager code, the kernels' own timings, the step's
# numerics against the eager engine, then the reference engine's step with the kernels and without them
# (AFD_DISABLE_TRITON=1), side by side in one run. `bash scripts/gpu_kernels.sh [tests|step|all]`.
# Results land in $OUT (at most 8 files come back): kernel_tests.txt, kernel_bench.jsonl, step_triton.json,
# step_eager_ops.json, profile.txt, log.txt.
set -u
source "$(dirname "$0")/device_env.sh"
PHASE=${1:-all}
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ $PHASE != step ]]; then
  t0=$SECONDS
  timeout 400 python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 380 \
    tests/test_kernel_moe.py tests/test_kernel_mla_decode.py tests/test_kernel_fused.py \
    tests/test_kernel_prefill_attention.py tests/test_cuda_graph.py tests/test_moe.py >"$OUT/kernel_tests.txt" 2>&1
  echo "kernel tests rc=$? in $((SECONDS - t0)) s"; grep -E "passed|failed|Error|FAILED" "$OUT/kernel_tests.txt" | tail -n 30
  for t in moe mla_decode fused prefill_attention; do
    timeout 90 python3 "tests/test_kernel_$t.py" >>"$OUT/kernel_bench.jsonl" 2>>"$OUT/log.txt" || echo "bench $t rc=$?"
  done
  timeout 200 python3 scripts/gpu_kernel_numerics.py >>"$OUT/kernel_bench.jsonl" || echo "numerics rc=$?"
  cat "$OUT/kernel_bench.jsonl"
fi
[[ $PHASE == tests ]] && exit 0
[[ $PHASE == step ]] && { timeout 200 python3 scripts/gpu_kernel_numerics.py >>"$OUT/kernel_bench.jsonl" || echo "numerics rc=$?"; cat "$OUT/kernel_bench.jsonl"; }
step() {
  local name=$1; shift
  local t0=$SECONDS
  timeout 300 python3 -m afd -v bench step --model deepseek-v2-lite --dtype bfloat16 --device cuda \
    --batch 1,8,64,256 --context 512 --prefill 8x1024 --steps 10 --json "$OUT/$name.json" "$@" 2>&1 | tail -n 14
  echo "$name rc=$? in $((SECONDS - t0)) s"
}
step step_triton
AFD_DISABLE_TRITON=1 step step_eager_ops
timeout 200 python3 scripts/gpu_step_profile.py --batch 8,256 >"$OUT/profile.txt" 2>&1 || echo "profile rc=$?"
timeout 120 python3 scripts/gpu_prefill_profile.py >>"$OUT/profile.txt" 2>&1 || echo "prefill profile rc=$?"
