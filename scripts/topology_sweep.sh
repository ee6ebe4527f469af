#!/usr/bin/env bash
# Topologies on the tiny preset (float32), each `afd generate` run compared with the single-process reference by
# scripts/compare_outputs.py (tokens equal, max |Δ logprob| <= 1e-4); RUNS is a list of connector:AxF.
#   scripts/topology_sweep.sh cpu|cuda "p2p:2x2 async:3x1 ..." OUTDIR
set -u
DEVICE=$1; RUNS=$2; DIR=${3:-/tmp/afd_sweep}
mkdir -p "$DIR"
PROMPTS="5,17,33,2,9,41,7,3,19,23,11;4,8;100,3,77,12,9,250;1;7,7,7,7;200,100,50;9;13,14,15,16,17,18"
COMMON=(--model tiny --prompt-ids "$PROMPTS" --max-new-tokens 8 --prompt-logprobs --device "$DEVICE" --json)
python3 -m afd generate "${COMMON[@]}" >"$DIR/ref.json"
for run in $RUNS; do
  connector=${run%%:*}; shape=${run#*:}; a=${shape%x*}; f=${shape#*x}
  name="${connector}_${a}a${f}f"
  t0=$SECONDS
  timeout "${STEP_TIMEOUT:-300}" python3 -m afd generate "${COMMON[@]}" --connector "$connector" --attention "$a" --ffn "$f" \
    >"$DIR/$name.json" 2>"$DIR/$name.err"
  rc=$?
  printf '%-14s rc=%s %3ss  ' "$name" "$rc" "$((SECONDS - t0))"
  if [ "$rc" = 0 ]; then python3 scripts/compare_outputs.py "$DIR/ref.json" "$DIR/$name.json" | sed 's|.*: ||'
  else tail -n 1 "$DIR/$name.err"; fi
done
