#!/usr/bin/env bash
# Round 16f (nvidia-h200-x2, about 3 minutes; the session's last device time): FFN expert-pass graphs at prefill
# sizes — their GPU tests, then 1A1F prefill of 8 x 1024 with 1 and 2 micro-batches (async+sa, one launch each).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r16f
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_ffn_graphs.py 2>&1 | tail -n 12
bench prefill_ffn_graphs 100 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 1,2 --shared-experts attention --connectors async --max-num-batched-tokens 8192 --no-score
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
