#!/usr/bin/env bash
# Round 15, call c: after the sampling warm-up (a fresh process's first step spent ~18 ms in its tail). 1A1F prefill
# of 8 x 1024 with and without the shared experts on the attention rank, 1 and 2 micro-batches, p2p beside (3 launches
# each); its timeline; the 1A1F decode step of 64 x 512 beside one GPU's step measured in the same call; serving the
# mixed workload at 1A1F with the async server's shared experts on its attention rank. At most 8 files come back.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r15c
bench prefill 220 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
  --ubatches 1,2 --shared-experts ffn,attention --repeat 3 --connectors async,p2p --max-num-batched-tokens 8192 \
  --no-score
export AFD_TIMELINE=$B/tl
bench prefill_sa_timelined 60 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --shared-experts attention --connectors async --max-num-batched-tokens 8192 --no-score
unset AFD_TIMELINE
python3 -m afd.profiling.timeline_report "$B/tl" --json "$OUT/prefill_sa_timeline.json" | grep -E "step|round trip|FFN pass"
bench decode_b64 100 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32 \
  --shared-experts ffn,attention --connectors async,p2p --no-score
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m afd bench step --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --batch 64 --context 512 --prefill 8x1024 --json "$OUT/step_one_gpu.json" 2>"$B/step.err" | tail -n 6
timeout 240 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 64 --rates 64,inf --warmups 8 \
  --short-len 64 --long-len 1024 --max-tokens 64 \
  --config '{"connector": "async", "connector_extra_config": {"shared_experts_on_attention": true}}' \
  --json "$OUT/serve_mixed_1a1f_sa.json" 2>"$B/serve.err" | tail -n 10
rc=${PIPESTATUS[0]}; echo "serve rc=$rc"; [[ $rc == 0 ]] || tail -n 30 "$B/serve.err" > "$OUT/serve.err"
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
