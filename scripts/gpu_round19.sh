#!/usr/bin/env bash
# Written for the session after round 18 (nvidia-h200-x2). Run `cold` as the session's FIRST call (a fresh machine:
# Triton's disk cache is empty, as a user's first start is).
# `bash scripts/gpu_round19.sh cold`: which Triton kernels compile while serving (round 18: a fresh machine's first
#   decode row paid ~260 ms of TTFT): the 1A1F decode row with AFD_LOG_DIR, then every rank log's compile lines.
# `bash scripts/gpu_round19.sh mps`: 2A2F async serving under CUDA MPS (round 17: 61 req/s at 2A2F against 103 at
#   1A1F; the attention and FFN processes on one GPU time-slice without it), if the image has the MPS daemon.
set -u
PHASE=${1:-cold}
source "$(dirname "$0")/device_env.sh"
log_run r19
if [[ $PHASE == cold ]]; then
  export AFD_LOG_DIR=$B/logs
  # one GPU (the x2 kind not lent): async 1A1F with both PEs on it; p2p cannot put two NCCL ranks on one GPU
  CONNECTORS=async,p2p; [[ $(nvidia-smi -L | wc -l) -ge 2 ]] || CONNECTORS=async
  bench decode_1a1f_cold 200 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32 \
    --connectors $CONNECTORS
  grep -h "while serving" "$AFD_LOG_DIR"/*/*.log | sed 's/.*afd.profiling.profiler INFO //' | sort | uniq -c | sort -rn \
    | head -n 40 | tee "$OUT/compiled_while_serving.txt"
  tail -q -n 200 "$AFD_LOG_DIR"/*/*.log | grep -h "Triton:" | tee -a "$OUT/compiled_while_serving.txt"
elif [[ $PHASE == mps ]]; then
  if ! command -v nvidia-cuda-mps-control >/dev/null; then echo "no MPS daemon in this image"; exit 0; fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
  serve_mixed serve_mixed_2a2f_mps 280 --compare async:A=2,F=2,async:A=1,F=1 --requests 512 --rates inf --warmups 16
  echo quit | nvidia-cuda-mps-control; tail -n 5 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
