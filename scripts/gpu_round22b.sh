#!/bin/bash
# Round 22, call b (one H200, ~8 minutes): the front end's share of TTFT now (afd's HTTP server, chunks written
# from the link's callback, replicas framing the link themselves) against the session's start (cc85dd4, aiohttp's
# server), alternated in one call, 32 requests a run (`front_end` of device_env.sh, busy polling). The old tree
# is .whl/old.tar (`git archive cc85dd4 -- src`).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22b
export CUDA_VISIBLE_DEVICES=0 FRONT_REQUESTS=32
front_end_ab 3 440 front_now front_aiohttp
