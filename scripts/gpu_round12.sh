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
elif [[ $PHASE == chain ]]; then
# device-driven FFN passes (afd.connectors.asynchronous.ffn_chain): the exchange per layer inside a 26-layer pass, with the chain
# and without (AFD_FFN_CHAIN=0), single round trips beside; the ordering stress through the chain; afd bench 1A1F
ex() {  # name, then afd bench exchange arguments
  local name=$1; shift
  timeout 150 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda "$@" \
    --json "$B/$name.json" 2>"$B/$name.err" | tail -n +2
  echo "$name rc=$?"
}
ex exchange_pass26 --tokens 1,8,64,256 --iters 50 --layers 26
AFD_FFN_CHAIN=0 ex exchange_pass26_host --tokens 1,8,64,256 --iters 50 --layers 26 --connectors async
ex exchange_single --tokens 1,8,64,512,4096 --iters 100
timeout 150 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --stress 20000 \
  --tokens 256 --json "$B/stress.json" 2>"$B/stress.err" | tail -n 2
timeout 200 python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 1 --ffn 1 \
  --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64 --json "$B/1a1f.json" 2>"$B/1a1f.err" | tail -n 7
tar -czf "$OUT/chain.tar.gz" -C "$B" .
elif [[ $PHASE == chain2 ]]; then
# the chain's three Triton kernels against their PyTorch steps; the exchange per layer in a 26-layer pass (reply
# headers read back through a ring: the attention host no longer waits for the previous layer); where a pass's
# time goes (AFD_BENCH_PROFILE); the stress and afd bench 1A1F again
timeout 120 python3 -m pytest -q -m gpu tests/test_ffn_chain.py -p no:cacheprovider 2>&1 | tail -n 3
timeout 150 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --tokens 1,8,64,256 \
  --iters 50 --layers 26 --json "$B/exchange_pass26.json" 2>"$B/exchange_pass26.err" | tail -n +2
AFD_BENCH_PROFILE=$B/prof timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 \
  --device cuda --tokens 8 --iters 20 --layers 26 --connectors async 2>"$B/exchange_prof.err" | tail -n 2
timeout 150 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --stress 20000 \
  --tokens 256 --json "$B/stress.json" 2>"$B/stress.err" | tail -n 2
timeout 200 python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 1 --ffn 1 \
  --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64 --connectors async --json "$B/1a1f.json" \
  2>"$B/1a1f.err" | tail -n 4
tar -czf "$OUT/chain2.tar.gz" -C "$B" .
elif [[ $PHASE == waits ]]; then
# the two device-side waits side by side (NVSHMEM's spinning kernel vs the driver's stream memory operation), a
# timeline of a few 26-layer passes (chrome traces of both ranks), afd bench 1A1F with the wider warm-up
for w in nvshmem memop; do
  AFD_STREAM_WAIT=$w timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda \
    --tokens 1,8,64,256 --iters 50 --layers 26 --connectors async --json "$B/exchange_pass26_$w.json" \
    2>"$B/exchange_pass26_$w.err" | tail -n 5
  echo "wait=$w rc=$?"
done
AFD_BENCH_PROFILE=$B/trace timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 \
  --device cuda --tokens 8 --iters 3 --layers 26 --connectors async 2>"$B/exchange_trace.err" | tail -n 1
gzip -f "$B"/trace/*.json
timeout 220 python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 1 --ffn 1 \
  --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64 --json "$B/1a1f.json" 2>"$B/1a1f.err" | tail -n 6
tar -czf "$OUT/waits.tar.gz" -C "$B" .
elif [[ $PHASE == graphs ]]; then
# async 1A1F decode steps captured whole (exchanges included): the GPU tests, then the exchange in a 26-layer pass
timeout 240 python3 -m pytest -q -s -m gpu tests/test_ffn_chain.py -p no:cacheprovider -x 2>&1 | tail -n 30
timeout 90 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --tokens 8,64 \
  --iters 50 --layers 26 --json "$B/exchange_pass26.json" 2>"$B/exchange_pass26.err" | tail -n 5
tar -czf "$OUT/graphs.tar.gz" -C "$B" .
elif [[ $PHASE == final ]]; then
# the last call: the captured-step oracle, then by priority afd bench 1A1F (decode), the serving table, the
# micro-batching prefill target, 2A2F, the front end's overhead; each result lands in $OUT as it is made
timeout 100 python3 -m pytest -q -s -m gpu tests/test_ffn_chain.py -k captured -p no:cacheprovider 2>&1 | tail -n 3
bench 1a1f 150 --attention 1 --ffn 1 --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64
t0=$SECONDS
timeout 170 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 32 --rates 4,32 \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed.json" 2>"$B/serve.err" | tail -n 12
echo "serve rc=$? in $((SECONDS - t0)) s"; grep -v "^\[afd" "$B/serve.err" | tail -n 3
bench 1a1f_prefill_ubatches 120 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2,3
bench 2a2f 90 --attention 2 --ffn 2 --requests 8 --long-len 1024 --short-len 32 --max-new-tokens 64
timeout 70 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --json "$OUT/overhead.json" \
  2>"$B/overhead.err" | tail -n 3
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
