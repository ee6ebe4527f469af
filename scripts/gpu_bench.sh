#!/usr/bin/env bash
# Side-by-side connector benchmarks on the device machine (nvidia-h200-x2); raw JSON lands in $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
bench() {
  local name=$1; shift
  echo "== $name: afd bench $*"
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-300}" python3 -m afd bench "$@" --json "$OUT/$name.json" 2>"$OUT/$name.err"
  echo "rc=$? in $((SECONDS - t0)) s"
  tail -n 3 "$OUT/$name.err"
}
bench lite_bf16_2a2f --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 2 --ffn 2 \
  --requests 8 --long-len 1024 --short-len 32 --max-new-tokens 64 "$@"
bench lite_bf16_1a1f --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 1 --ffn 1 \
  --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64 "$@"
for f in "$OUT"/*.json; do echo "== raw $f"; cat "$f"; echo; done
