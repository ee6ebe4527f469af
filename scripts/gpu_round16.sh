#!/usr/bin/env bash
# Written for the session after round 15 (one call of under 10 minutes on nvidia-h200-x2): does two micro-batches'
# 18% (round 15 f, one launch, the shared experts on the attention rank) hold over 4 launches; where an m=2 layer's
# host time goes (timeline with the host split); and 2A2F with the shared experts on the attention rank (is it a
# safe default at F > 1?). `bash scripts/gpu_round16.sh serve` (a second call): the mixed workload at 2A2F with async
# both ways beside p2p and none R=2.
set -u
PHASE=${1:-bench}
source "$(dirname "$0")/device_env.sh"
log_run r16
if [[ $PHASE == serve ]]; then
timeout 540 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=2,F=2,async:A=2,F=2,async+sa:A=2,F=2 --workload mixed --requests 64 --rates 32,inf \
  --warmups 8 --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed_2a2f.json" 2>"$B/serve.err" \
  | tail -n 14
rc=${PIPESTATUS[0]}; echo "serve rc=$rc"; [[ $rc == 0 ]] || tail -n 40 "$B/serve.err" > "$OUT/serve.err"
else
bench prefill_repeat4 240 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 1,2 --shared-experts ffn,attention --repeat 4 --connectors async --max-num-batched-tokens 8192 --no-score
timelined prefill_sa_m2 60 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 2 --shared-experts attention --connectors async --max-num-batched-tokens 8192 --no-score
bench bench_2a2f 150 --attention 2 --ffn 2 --requests 16 --long-len 1024 --short-len 64 --max-new-tokens 32 \
  --shared-experts ffn,attention --connectors async,p2p
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
