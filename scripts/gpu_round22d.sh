#!/bin/bash
# Round 22, call d (one H200, ~9 minutes): serving at capacity through afd's own HTTP server (`none` R=1, mixed
# workload, 128 requests at once, as round 21c), then the front end's share of TTFT now against the session's
# start (cc85dd4, aiohttp's server), alternated, 32 requests a run, as call c, on a fresh machine.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22d
export CUDA_VISIBLE_DEVICES=0 FRONT_REQUESTS=32
serve_mixed serve_mixed_1gpu 150 --compare none:R=1 --requests 128 --rates inf --warmups 8
front_end_ab 3 440 front_now front_aiohttp
