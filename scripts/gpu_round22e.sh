#!/bin/bash
# Round 22, call e (one H200, ~4 minutes): as call d's front-end runs (now against cc85dd4, alternated, 32
# requests a run), two pairs, after the benchmark client's own reads moved to a buffered protocol of its own.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22e
export CUDA_VISIBLE_DEVICES=0 FRONT_REQUESTS=32
front_end_ab 2 150 front_now front_aiohttp
