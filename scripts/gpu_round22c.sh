#!/bin/bash
# Round 22, call c (one H200, ~9 minutes): as call b (scripts/gpu_round22b.sh: now against the session's start,
# cc85dd4, alternated, 32 requests a run) after reads into buffers of ours (no 256 KiB / 1 MiB allocation per
# packet); then scripts/cold_path.py (a Python path once a second against back to back, on this host).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r22c
export CUDA_VISIBLE_DEVICES=0 FRONT_REQUESTS=32
front_end_ab 3 400 front_now front_aiohttp
(( SECONDS < 520 )) && timeout 70 python3 scripts/cold_path.py --samples 10 --every 1 > "$OUT/cold_path.json" && cat "$OUT/cold_path.json"
