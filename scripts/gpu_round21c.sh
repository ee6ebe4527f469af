#!/usr/bin/env bash
# Round 21c (one H200, ~4 minutes): serving through forked async ranks (1A1F, both PEs on the one GPU) at HEAD, the
# mixed workload at once, against `none` R=1 on the same GPU; checks the serving path of forked NVSHMEM ranks.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r21c
export CUDA_VISIBLE_DEVICES=0
serve_mixed serve_mixed_1gpu 280 --compare none:R=1,async:A=1,F=1 --requests 128 --rates inf --warmups 8
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
