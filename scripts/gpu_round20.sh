#!/usr/bin/env bash
# Written for the session after round 19. `bash scripts/gpu_round20.sh front` (one H200 is enough, ~4 minutes): the
# front end's share of TTFT with the replica link on an abstract Unix socket (round 19f, loopback TCP: 1.10-1.29 ms
# p50 with busy polling), three runs. `bash scripts/gpu_round20.sh x2` (nvidia-h200-x2, ~8 minutes): serving
# capacity at 512 requests, async 1A1F against none R=2, with TCP_NODELAY and nothing compiled mid-run (rounds
# 17-18 ran before both), then async 1A1F with two micro-batches in ping-pong (on prefill and mixed steps; captured
# decode steps do not split: round 16 measured +29.8% on 8 x 1024 prefill). `... x2b`: async 2A2F, plain and under
# CUDA MPS if the image has its daemon.
set -u
PHASE=${1:-front}
source "$(dirname "$0")/device_env.sh"
log_run r20
if [[ $PHASE == front ]]; then
  export CUDA_VISIBLE_DEVICES=0
  for i in 1 2 3; do AFD_BUSY_POLL=1 front_end front_end_bp1_unix_$i; done
elif [[ $PHASE == x2 ]]; then
  serve_mixed serve_mixed_512 280 --compare none:R=2,async:A=1,F=1 --requests 512 --rates inf --warmups 16
  serve_mixed serve_mixed_512_ubatch2 200 --compare async:A=1,F=1,U=2 --requests 512 --rates inf --warmups 16
elif [[ $PHASE == x2b ]]; then
  serve_mixed serve_mixed_512_2a2f 200 --compare async:A=2,F=2 --requests 512 --rates inf --warmups 16
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS daemon started"
    serve_mixed serve_mixed_2a2f_mps 200 --compare async:A=2,F=2 --requests 512 --rates inf --warmups 16
    echo quit | nvidia-cuda-mps-control
  else
    echo "no MPS daemon in this image"
  fi
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
