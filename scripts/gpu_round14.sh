#!/usr/bin/env bash
# Round 14 device calls, written after round 13 for what it left open. Each phase is one call of under 10 minutes on
# nvidia-h200-x2: `bash scripts/gpu_round14.sh prefill` (micro-batching with one large prefill step: does the 15%
# target hold once the token budget is not the bottleneck?), then `bash scripts/gpu_round14.sh serve` (the mixed
# workload with --warmups, so the first rate no longer pays first-shape costs, at rates that find the knee). Later
# phases: serve2a2f, timeline, final, last (docs/performance.md, round 14, calls c-g) and `next`, written for the
# session after: the p2p warm-up exchange and micro-batching with --repeat.
set -u
PHASE=${1:-prefill}
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
B=/tmp/afd_r14; mkdir -p "$B"
# The phases below are kept as they ran in round 14 (the timeline ones' output names since unified). Since then duplicate --ubatches entries run once: repeated
# launches are `afd bench --repeat N`.
if [[ $PHASE == prefill ]]; then
bench 1a1f_prefill_8192_ubatches 300 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2,3 --connectors async,p2p --max-num-batched-tokens 8192
export AFD_PROFILE=$B/prof
bench 1a1f_prefill_8192_profile 120 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --connectors async --max-num-batched-tokens 8192 --no-score
unset AFD_PROFILE
mkdir -p "$OUT/prof" && cp "$B"/prof/*.txt "$OUT/prof/"
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m afd bench step --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --batch 64 --context 512 --prefill 8x1024 --json "$OUT/step.json" 2>"$B/step.err" | tail -n 5
elif [[ $PHASE == serve2a2f ]]; then
# round 14's first serve call (1A1F) left the SLO unbound and async/p2p at 0.91x: with one attention rank there is
# no waiting between replicas to remove. 2A2F is where p2p's lock-step wave waits and async's replicas do not.
timeout 330 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=2,F=2,async:A=2,F=2 --workload mixed --requests 64 --rates 32,64,inf --warmups 8 \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed_2a2f.json" 2>"$B/serve.err" | tail -n 16
rc=${PIPESTATUS[0]}; echo "serve rc=$rc"; [[ $rc == 0 ]] || tail -n 60 "$B/serve.err" > "$OUT/serve.err"
# the prefill micro-batching runs again, each count twice (one launch each: the second of a pair shows what the
# first paid for kernels compiled on first use), and over 4 steps of 8,192 tokens
bench 1a1f_prefill_8192_ubatches_twice 200 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2,3,1,2,3 --connectors async --max-num-batched-tokens 8192 --no-score
bench 1a1f_prefill_32x1024_ubatches 150 --attention 1 --ffn 1 --requests 32 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2,3 --connectors async --max-num-batched-tokens 8192 --no-score
elif [[ $PHASE == timeline ]]; then
# where the async 1A1F prefill's time goes, without a profiler (AFD_TIMELINE: a few CUDA events per exchange and
# the engine's step ends), the raw points kept; then micro-batching on and off in turns, three launches each
timelined 1a1f_prefill_32x1024 150 --attention 1 --ffn 1 --requests 32 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --connectors async --max-num-batched-tokens 8192 --no-score
bench 1a1f_prefill_32x1024_ubatches_alternating 240 --attention 1 --ffn 1 --requests 32 --long-len 1024 \
  --short-len 1024 --max-new-tokens 1 --connectors async --max-num-batched-tokens 8192 --no-score \
  --ubatches 1,2,1,2,1,2
elif [[ $PHASE == final ]]; then
# after the full-step warm-up (the first big prefill step no longer pays for kernel loading) and the stream's
# headers sent after the submit: micro-batching again, then the front end's share of TTFT at 1 request/s
bench 1a1f_prefill_8x1024_ubatches_warm 230 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2,3,1,2,3 --connectors async --max-num-batched-tokens 8192 --no-score
bench 1a1f_prefill_8x1024_p2p_warm 90 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2 --connectors p2p --max-num-batched-tokens 8192 --no-score
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 \
  --device cuda --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 32 \
  --json "$OUT/overhead.json" 2>"$B/overhead.err" | tail -n 3
rc=${PIPESTATUS[0]}; echo "overhead rc=$rc"; [[ $rc == 0 ]] || tail -n 60 "$B/overhead.err" > "$OUT/overhead.err"
elif [[ $PHASE == last ]]; then
# where p2p's 1A1F prefill goes (AFD_TIMELINE now covers p2p), micro-batching in 4 alternating pairs of launches,
# and the 1A1F decode step once more (issue 11: <= 1.15x its compute, round 13: 1.17x)
timelined 1a1f_prefill_8x1024_p2p 60 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --connectors p2p --max-num-batched-tokens 8192 --no-score
elif [[ $PHASE == next ]]; then
# for the next session: does the p2p warm-up exchange remove the 569 ms of its first send (timeline), and the
# micro-batching target as medians of 4 launches each
timelined 1a1f_prefill_8x1024_p2p_warm_exchange 60 --attention 1 --ffn 1 --requests 8 --long-len 1024 \
  --short-len 1024 --max-new-tokens 1 --connectors p2p --max-num-batched-tokens 8192 --no-score
bench 1a1f_prefill_8x1024_ubatches_repeat4 300 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2,3 --repeat 4 --connectors async,p2p --max-num-batched-tokens 8192 --no-score
bench 1a1f_decode_b64 90 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32 \
  --connectors async --no-score
else
timeout 420 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 64 --rates 32,64,inf --warmups 8 \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed.json" 2>"$B/serve.err" | tail -n 16
rc=${PIPESTATUS[0]}; echo "serve rc=$rc"; [[ $rc == 0 ]] || tail -n 60 "$B/serve.err" > "$OUT/serve.err"
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
