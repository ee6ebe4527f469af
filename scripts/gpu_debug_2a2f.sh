#!/usr/bin/env bash
# Debug the async 2A2F run on CUDA (tiny): with device waits, then with AFD_ASYNC_HOST_WAIT=1; every rank log shown.
set -u
source "$(dirname "$0")/device_env.sh"
PROMPTS="5,17,33,2,9,41,7,3,19,23,11;4,8;100,3,77,12,9,250;1"
for mode in device host; do
  [ $mode = host ] && export AFD_ASYNC_HOST_WAIT=1
  rm -rf /tmp/afd_run_*
  echo "== async 2A2F, $mode waits"
  NVSHMEM_DEBUG=WARN timeout 90 python3 -m afd generate --model tiny --prompt-ids "$PROMPTS" --max-new-tokens 8 \
    --device cuda --connector async --attention 2 --ffn 2 --json >"$OUT/2a2f_$mode.json" 2>"$OUT/2a2f_$mode.err"
  echo "rc=$?"; tail -n 5 "$OUT/2a2f_$mode.err"
  for f in /tmp/afd_run_*/*; do echo "-- $f"; tail -n 25 "$f"; done
done
