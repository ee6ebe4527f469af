#!/bin/bash
# Round 22 (one H200, ~8 minutes): the front end's share of TTFT on afd's own HTTP server
# (`afd.serve.http_server`) against the aiohttp server it replaced, alternated in one call: the same
# command (`front_end` of device_env.sh, busy polling), the previous commit's tree (.whl/old.tar, made by
# `git archive HEAD~1`) for the aiohttp runs.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22
export CUDA_VISIBLE_DEVICES=0
python3 --version
NEW=$PWD
mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree && cp -r .whl /tmp/old_tree/
for i in 1 2 3; do
  (( SECONDS < 470 )) || break
  AFD_BUSY_POLL=1 front_end front_own_http_$i
  (( SECONDS < 520 )) || break
  (cd /tmp/old_tree && PYTHONPATH=/tmp/old_tree/src:/tmp/site AFD_BUSY_POLL=1 front_end front_aiohttp_$i)
done
cd "$NEW"
