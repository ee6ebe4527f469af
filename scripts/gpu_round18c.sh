#!/usr/bin/env bash
# Round 18c (nvidia-h200-x2, the last ~6 minutes of the session's device time): the FFN chain's items at prefill
# sizes (buckets up to the slot's rows, the padding never written back). Kernel tests; the exchange at T = 1, 64,
# 512, 4096 (round 18b: 230.6 and 375.5 us at 512 and 4096, served by the FFN host); the captured stress up to
# 4,096 rows; the 1A1F decode row (a real model through the chain, bf16 numerics scored).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r18c
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_chain_kernels.py 2>&1 | tail -n 4
timeout 100 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --iters 50 \
  --layers 26 --tokens 1,64,512,4096 --graph --connectors async --json "$OUT/exchange_large.json" \
  2>"$B/exchange.err" | tail -n 6
echo "exchange rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/exchange.err" | grep -iv warn | tail -n 3
timeout 60 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --stress 20000 \
  --graph --tokens 4096 --json "$OUT/stress_graph_4096.json" 2>"$B/stress.err" | tail -n 2
echo "stress rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/stress.err" | grep -iv warn | tail -n 3
bench decode_1a1f 100 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32 \
  --connectors async
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
