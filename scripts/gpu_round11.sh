#!/usr/bin/env bash
# The next device call (nvidia-h200-x2), written after round 8 for what that session could not run: p2p with one
# FFN rank now replays the FFN graphs (check it, and compare with AFD_FFN_GRAPHS=0), p2p micro-batching on NCCL,
# the micro-batching target (1A1F prefill of 8 x 1024 tokens, 1/2/3 micro-batches, both connectors), 2A2F with the
# FFN graphs, and the serving table + the front end's overhead (engine alone now in its own process).
# Two calls of under 10 minutes each: `bash scripts/gpu_round11.sh bench`, then `bash scripts/gpu_round11.sh serve`.
set -u
PHASE=${1:-bench}
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
B=/tmp/afd_r11; mkdir -p "$B"
if [[ $PHASE == bench ]]; then
timeout 150 python3 -m pytest -q -s -m gpu tests/test_p2p_ubatch.py tests/test_ffn_graphs.py -p no:cacheprovider 2>&1 | tail -n 4
bench() {  # name, then afd bench arguments
  local name=$1; shift
  local t0=$SECONDS
  timeout 200 python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda "$@" \
    --json "$B/$name.json" 2>"$B/$name.err" | tail -n 9
  echo "$name rc=$? in $((SECONDS - t0)) s"
}
bench 1a1f --attention 1 --ffn 1 --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64
AFD_FFN_GRAPHS=0 bench 1a1f_no_ffn_graphs --attention 1 --ffn 1 --requests 8 --long-len 512 --short-len 32 \
  --max-new-tokens 64
bench 1a1f_prefill_ubatches --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 1,2,3
bench 2a2f --attention 2 --ffn 2 --requests 8 --long-len 1024 --short-len 32 --max-new-tokens 64
tar -czf "$OUT/bench.tar.gz" -C "$B" .
else
timeout 150 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 40 --json "$OUT/overhead.json" \
  2>"$OUT/overhead.err" | tail -n 3
timeout 280 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 48 --rates 4,16,64 \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed.json" 2>"$OUT/serve_mixed.err" | tail -n 16
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
