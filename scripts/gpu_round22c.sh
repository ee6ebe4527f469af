#!/bin/bash
# Round 22, call c (one H200, ~9 minutes): as call b (scripts/gpu_round22b.sh: now against the session's start,
# cc85dd4, alternated, 32 requests a run) after reads into buffers of ours (no 256 KiB / 1 MiB allocation per
# packet); then scripts/cold_path.py (a Python path once a second against back to back, on this host).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22c
export CUDA_VISIBLE_DEVICES=0 FRONT_REQUESTS=32
NEW=$PWD
mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree
for i in 1 2 3; do
  (( SECONDS < 400 )) || break
  AFD_BUSY_POLL=1 front_end front_now_$i
  (( SECONDS < 460 )) || break
  (cd /tmp/old_tree && PYTHONPATH=/tmp/old_tree/src:/tmp/site AFD_BUSY_POLL=1 front_end front_aiohttp_$i)
done
cd "$NEW"
(( SECONDS < 520 )) && timeout 70 python3 scripts/cold_path.py --samples 10 --every 1 > "$OUT/cold_path.json" && cat "$OUT/cold_path.json"
