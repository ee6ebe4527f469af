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
front_end_ab 3 470 front_own_http front_aiohttp
