#!/usr/bin/env bash
# Round 18b (nvidia-h200-x2, the session's last device time, under 9 minutes): the ordering stress through captured
# passes (the fused send and reply kernels, 100,000+ messages), the exchange table at every T (issue 11's targets),
# the 1A1F decode row over 3 launches each (round 18's single launch ran async first on a cold machine), and serving
# 1A1F with 1,024 requests per server, async first.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r18b
timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --stress 100000 \
  --graph --tokens 64 --json "$OUT/stress_graph.json" 2>"$B/stress.err" | tail -n 2
echo "stress rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/stress.err" | grep -iv warn | tail -n 3
timeout 150 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --iters 50 \
  --layers 26 --tokens 1,8,64,512,4096 --graph --connectors p2p,async --json "$OUT/exchange_all.json" \
  2>"$B/exchange_all.err" | tail -n 12
echo "exchange_all rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/exchange_all.err" | grep -iv warn | tail -n 3
bench decode_1a1f_repeat3 200 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 \
  --max-new-tokens 32 --connectors async,p2p --repeat 3
serve_mixed serve_mixed_1a1f_1024 190 --compare async:A=1,F=1,p2p:A=1,F=1 --requests 1024 --rates inf --warmups 16
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
