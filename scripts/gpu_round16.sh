#!/usr/bin/env bash
# Written for the session after round 15 (one call of under 10 minutes on nvidia-h200-x2): does two micro-batches'
# 18% (round 15 f, one launch, the shared experts on the attention rank) hold over 4 launches; where an m=2 layer's
# host time goes (timeline with the host split); and 2A2F with the shared experts on the attention rank (is it a
# safe default at F > 1?).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r16
bench prefill_repeat4 240 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 1,2 --shared-experts ffn,attention --repeat 4 --connectors async --max-num-batched-tokens 8192 --no-score
timelined prefill_sa_m2 60 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 2 --shared-experts attention --connectors async --max-num-batched-tokens 8192 --no-score
bench bench_2a2f 150 --attention 2 --ffn 2 --requests 16 --long-len 1024 --short-len 64 --max-new-tokens 32 \
  --shared-experts ffn,attention --connectors async,p2p
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
