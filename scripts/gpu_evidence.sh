#!/usr/bin/env bash
# The GPU evidence, run on the device machine (nvidia-h200-x2) from the repo root with the
# nvshmem4py-cu13 wheel carried in .whl/. Logs and JSON land in $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi -L
python3 -c "import torch, nvshmem.core; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
PROMPTS="5,17,33,2,9,41,7,3,19,23,11;4,8;100,3,77,12,9,250;1"
COMMON=(--model tiny --prompt-ids "$PROMPTS" --max-new-tokens 8 --prompt-logprobs --device cuda --json)
run() {
  local name=$1; shift
  echo "== $name: afd $*"
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-180}" python3 -m afd "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
  echo "rc=$? in $((SECONDS - t0)) s"
  tail -n 4 "$OUT/$name.err"
}
run ref generate "${COMMON[@]}"
run p2p_1a1f generate "${COMMON[@]}" --connector p2p --attention 1 --ffn 1
run async_1a1f generate "${COMMON[@]}" --connector async --attention 1 --ffn 1
run async_2a2f generate "${COMMON[@]}" --connector async --attention 2 --ffn 2
python3 scripts/compare_outputs.py "$OUT/ref.json" "$OUT"/p2p_1a1f.json "$OUT"/async_1a1f.json "$OUT"/async_2a2f.json \
  | tee "$OUT/compare.txt"
echo "== leftover processes:"; pgrep -af "afd worker" || echo none
