#!/usr/bin/env bash
# Written for the session after round 16 (nvidia-h200-x2, two calls of under 10 minutes).
# `bash scripts/gpu_round17.sh` (check): the graph tests on the GPU; the fp32 oracle on CUDA with the command line's
# defaults (async runs the shared experts on its attention ranks) at 1A1F, 1A2F and 2A2F, and with a token budget of
# 8 so that chunks after cached context and steps mixing them with decodes go through the prefill graphs; bf16
# numerics and speed at 2A2F (async vs p2p, prefill graphs and FFN prefill graphs on).
# `bash scripts/gpu_round17.sh serve`: the mixed workload with 512 requests per server at 2A2F and 1A1F, and async 1A1F
# without the FFN's device chain (round 16 e: async trailed p2p by 6% at 1A1F; one suspect is the chain's row
# prediction, which steps mixing prompts and decodes break).
# `bash scripts/gpu_round17.sh exchange`: where the captured exchange's ~40 us per layer go (issue 11: <= 25 us):
# `afd bench exchange --graph` at T = 8 under torch.profiler (kernels inside the replayed graphs included), both
# sides' tables.
set -u
PHASE=${1:-check}
source "$(dirname "$0")/device_env.sh"
log_run r17
if [[ $PHASE == exchange ]]; then
  AFD_BENCH_PROFILE=$B/prof timeout 200 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 \
    --device cuda --tokens 8 --iters 50 --layers 26 --graph --connectors async --json "$OUT/exchange_t8.json" \
    2>"$B/exchange.err" | tail -n 8
  echo "exchange rc=${PIPESTATUS[0]}"; cp "$B"/prof/*.txt "$OUT/" 2>/dev/null; tail -n 3 "$B/exchange.err"
elif [[ $PHASE == serve ]]; then
  serve_mixed serve_mixed_2a2f_512 280 --compare none:R=2,p2p:A=2,F=2,async:A=2,F=2 --requests 512 --rates inf \
    --warmups 16
  serve_mixed serve_mixed_1a1f_512 200 --compare p2p:A=1,F=1,async:A=1,F=1 --requests 512 --rates inf --warmups 16
  # does the FFN's device chain cost under serving (mixed steps break its row prediction)? its count, then without it
  grep -h "handed back to the host" "$B"/serve_mixed_1a1f_512.err | tail -n 2
  AFD_FFN_CHAIN=0 serve_mixed serve_mixed_1a1f_nochain 100 --compare async:A=1,F=1 --requests 512 --rates inf \
    --warmups 16
else
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_prefill_graph.py \
    tests/test_ffn_graphs.py tests/test_cuda_graph.py 2>&1 | tail -n 8
  export GEN_DIR=$B
  AFD_PREFILL_GRAPHS=0 gen ref "${ORACLE[@]}"
  gen async_1a1f "${ORACLE[@]}" --connector async --attention 1 --ffn 1
  gen async_1a2f "${ORACLE[@]}" --connector async --attention 1 --ffn 2
  gen async_2a2f "${ORACLE[@]}" --connector async --attention 2 --ffn 2
  gen async_1a1f_budget8 "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --max-num-batched-tokens 8
  gen p2p_1a1f_budget8 "${ORACLE[@]}" --connector p2p --attention 1 --ffn 1 --max-num-batched-tokens 8
  python3 scripts/compare_outputs.py "$B/ref.json" "$B"/async_1a1f.json "$B"/async_1a2f.json "$B"/async_2a2f.json \
    "$B"/async_1a1f_budget8.json "$B"/p2p_1a1f_budget8.json | tee "$OUT/compare.txt"
  bench bench_2a2f 200 --attention 2 --ffn 2 --requests 16 --long-len 1024 --short-len 64 --max-new-tokens 32 \
    --connectors async,p2p
  bench prefill_1a1f 150 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 --max-new-tokens 1 \
    --ubatches 1,2 --repeat 3 --connectors async,p2p --max-num-batched-tokens 8192 --no-score
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
