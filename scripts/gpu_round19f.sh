#!/usr/bin/env bash
# Round 19f (one H200): the front end with busy polling on in the benchmark's client too (its own wake-ups out of
# the measured share), twice.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19f
export CUDA_VISIBLE_DEVICES=0
AFD_BUSY_POLL=1 front_end front_end_bp1_client_spins
AFD_BUSY_POLL=1 front_end front_end_bp1_client_spins_again
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
