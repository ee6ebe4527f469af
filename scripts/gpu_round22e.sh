#!/bin/bash
# Round 22, call e (one H200, ~4 minutes): as call d's front-end runs (now against cc85dd4, alternated, 32
# requests a run), two pairs, after the benchmark client's own reads moved to a buffered protocol of its own.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22e
export CUDA_VISIBLE_DEVICES=0 FRONT_REQUESTS=32
NEW=$PWD
mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree
for i in 1 2; do
  (( SECONDS < 150 )) || break
  AFD_BUSY_POLL=1 front_end front_now_$i
  (( SECONDS < 190 )) || break
  (cd /tmp/old_tree && PYTHONPATH=/tmp/old_tree/src:/tmp/site AFD_BUSY_POLL=1 front_end front_aiohttp_$i)
done
cd "$NEW"
