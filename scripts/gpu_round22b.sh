#!/bin/bash
# Round 22, call b (one H200, ~8 minutes): the front end's share of TTFT now (afd's HTTP server, chunks written
# from the link's callback, replicas framing the link themselves) against the session's start (cc85dd4, aiohttp's
# server), alternated in one call, 32 requests a run (`front_end` of device_env.sh, busy polling). The old tree
# is .whl/old.tar (`git archive cc85dd4 -- src`).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22b
export CUDA_VISIBLE_DEVICES=0 FRONT_REQUESTS=32
NEW=$PWD
mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree
for i in 1 2 3; do
  (( SECONDS < 440 )) || break
  AFD_BUSY_POLL=1 front_end front_now_$i
  (( SECONDS < 500 )) || break
  (cd /tmp/old_tree && PYTHONPATH=/tmp/old_tree/src:/tmp/site AFD_BUSY_POLL=1 front_end front_aiohttp_$i)
done
cd "$NEW"
