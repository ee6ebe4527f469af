#!/usr/bin/env bash
# Round 12 device calls (nvidia-h200-x2). `probe`: the GPU tests round 11 left unrun (p2p micro-batching on NCCL, p2p
# FFN graphs) and where one exchange round trip's ~500 us go (`afd bench exchange` with AFD_BENCH_PROFILE: cProfile +
# torch.profiler per rank).
set -u
PHASE=${1:-probe}
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
B=/tmp/afd_r12; mkdir -p "$B"
if [[ $PHASE == probe ]]; then
timeout 150 python3 -m pytest -q -s -m gpu tests/test_p2p_ubatch.py tests/test_ffn_graphs.py -p no:cacheprovider 2>&1 | tail -n 6
timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --tokens 1,8,64 \
  --iters 200 --json "$B/exchange.json" 2>"$B/exchange.err" | tail -n 8
AFD_BENCH_PROFILE=$B/prof timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 \
  --device cuda --tokens 8 --iters 100 2>"$B/exchange_prof.err" | tail -n 4
tar -czf "$OUT/probe.tar.gz" -C "$B" .
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
