#!/usr/bin/env bash
# Round 13 device calls (nvidia-h200-x2), written after round 12 for what it could not measure. Two calls of under
# 10 minutes: `bash scripts/gpu_round13.sh exchange` (the captured exchange alone, the decode-step target, the
# micro-batching target, afd bench with the FFN-ready barrier), then `bash scripts/gpu_round13.sh serve`; on one GPU
# (nvidia-h200) `bash scripts/gpu_round13.sh single`.
set -u
PHASE=${1:-exchange}
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
B=/tmp/afd_r13; mkdir -p "$B"
if [[ $PHASE == single ]]; then
# what one GPU can measure (nvidia-h200): cross-replica FFN batching (<= 1.3x), the front end's share of TTFT
# (<= 1 ms p50 at 1 request/s, paired inside the server's run), micro-batched async prefill on co-located ranks
timeout 150 python3 scripts/gpu_cross_replica.py --tokens 1,8,32,64 > "$OUT/cross_replica.jsonl" 2>"$B/cross.err"
echo "cross_replica rc=$?"; cat "$OUT/cross_replica.jsonl"; grep -v "^\[afd" "$B/cross.err" | tail -n 3
timeout 260 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 40 --rates 1 \
  --json "$OUT/overhead.json" 2>"$B/overhead.err" | tail -n 4
echo "overhead rc=$?"; grep -v "^\[afd" "$B/overhead.err" | tail -n 3
bench 1a1f_colocated_ubatches 150 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 2 --ubatches 1,2 --connectors async
elif [[ $PHASE == graph ]]; then
# call 2 on nvidia-h200-x2: what call 1 (`exchange`) could not finish: the captured exchange (fixed: inference mode),
# micro-batched prefill with room to finish, the front end's share of TTFT after the link rewrite, 2A2F
timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --tokens 1,8,64 \
  --iters 50 --layers 26 --graph --json "$OUT/exchange_graph.json" 2>"$B/exchange_graph.err" | tail -n 8
rc=${PIPESTATUS[0]}; echo "exchange_graph rc=$rc"; [[ $rc == 0 ]] || tail -n 60 "$B/exchange_graph.err" > "$OUT/exchange_graph.err"
bench 1a1f_prefill_ubatches 230 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2 --connectors async,p2p
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 \
  --device cuda --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 30 --rates 1 \
  --json "$OUT/overhead.json" 2>"$B/overhead.err" | tail -n 2
echo "overhead rc=$?"; grep -v "^\[afd" "$B/overhead.err" | tail -n 3
bench 2a2f 110 --attention 2 --ffn 2 --requests 8 --long-len 1024 --short-len 32 --max-new-tokens 64
elif [[ $PHASE == last ]]; then
# call 3 on nvidia-h200-x2: the captured exchange (bench now in inference mode), serving (the 1.9x target), the
# front end's share of TTFT beside the HTTP floor
timeout 110 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --tokens 1,8,64 \
  --iters 50 --layers 26 --graph --json "$OUT/exchange_graph.json" 2>"$B/exchange_graph.err" | tail -n 8
rc=${PIPESTATUS[0]}; echo "exchange_graph rc=$rc"; [[ $rc == 0 ]] || tail -n 60 "$B/exchange_graph.err" > "$OUT/exchange_graph.err"
timeout 280 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 48 --rates 24,inf \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed.json" 2>"$B/serve.err" | tail -n 14
rc=${PIPESTATUS[0]}; echo "serve rc=$rc"; [[ $rc == 0 ]] || tail -n 60 "$B/serve.err" > "$OUT/serve.err"
CUDA_VISIBLE_DEVICES=0 timeout 130 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 \
  --device cuda --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --rates 1 \
  --json "$OUT/overhead.json" 2>"$B/overhead.err" | tail -n 2
echo "overhead rc=$?"
elif [[ $PHASE == profile ]]; then
# call 4 on nvidia-h200-x2: why a 1A1F prefill of 8 x 1024 takes ~4x one GPU's whole prefill: every rank profiled
# (AFD_PROFILE), beside one GPU's prefill step profiled the same way
export AFD_PROFILE=$B/prof
bench 1a1f_prefill_profile 150 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --connectors async,p2p
unset AFD_PROFILE
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 scripts/gpu_prefill_profile.py --batch 8 --prompt-len 1024 \
  > "$OUT/one_gpu_prefill_profile.txt" 2>&1; echo "one-gpu prefill profile rc=$?"; tail -n 5 "$OUT/one_gpu_prefill_profile.txt"
mkdir -p "$OUT/prof" && cp "$B"/prof/*.txt "$OUT/prof/" && gzip -c "$B/prof/async_attention0.trace.json" > "$OUT/prof/async_attention0.trace.json.gz"
gzip -c "$B/prof/async_ffn0.trace.json" > "$OUT/prof/async_ffn0.trace.json.gz"; ls -la "$OUT/prof"
for f in "$B"/prof/*.txt; do echo "== $f"; grep -A 14 "Self CUDA" "$f" | tail -n 16 | cut -c 1-160; done
elif [[ $PHASE == uvloop ]]; then
# call 5 on nvidia-h200 (ran at 118a338 with a uvloop wheel in .whl): the front end's share of TTFT on asyncio's loop and
# on uvloop. uvloop measured no gain there (1.89 vs 1.99 ms p50), so the switch was taken out again after it.
for loop in 0 1; do
  AFD_UVLOOP=$loop timeout 110 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
    --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --rates 1 \
    --json "$OUT/front_end_uvloop$loop.json" 2>"$B/uv$loop.err" | tail -n 1
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['results'][0]['runs'][0]; print('AFD_UVLOOP=$loop front end p50', \
    s['summary']['front_end_p50_s'], 'p90', s['summary']['front_end_p90_s'], 'http floor', s['http_floor_p50_s'])" \
    "$OUT/front_end_uvloop$loop.json"
done
elif [[ $PHASE == exchange ]]; then
# the exchange inside a captured 26-layer pass (target: <= 25 us per layer at T <= 64), beside eager passes
timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --tokens 1,8,64,256 \
  --iters 50 --layers 26 --graph --json "$OUT/exchange_graph.json" 2>"$B/exchange_graph.err" | tail -n 10
grep -v "^\[afd" "$B/exchange_graph.err" | tail -n 3
# the same with the driver's stream memory operation as the wait (no SM spins; does it capture?)
AFD_STREAM_WAIT=memop timeout 100 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 \
  --device cuda --tokens 8,64 --iters 50 --layers 26 --graph --connectors async 2>"$B/exchange_memop.err" | tail -n 3
grep -v "^\[afd" "$B/exchange_memop.err" | tail -n 3
# the decode-step target: 1A1F at 64 sequences x 512 context vs one GPU's whole step (attention + FFN compute)
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m afd bench step --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --batch 64 --context 512 --json "$OUT/step_b64.json" 2>"$B/step.err" | tail -n 4
bench 1a1f_b64 150 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32 \
  --connectors async,p2p
bench 1a1f_prefill_ubatches 130 --attention 1 --ffn 1 --requests 8 --long-len 1024 --short-len 1024 \
  --max-new-tokens 1 --ubatches 1,2,3
bench 1a1f 120 --attention 1 --ffn 1 --requests 8 --long-len 512 --short-len 32 --max-new-tokens 64
else
t0=$SECONDS
timeout 300 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 48 --rates 32,96,inf \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed.json" 2>"$B/serve.err" | tail -n 14
echo "serve rc=$? in $((SECONDS - t0)) s"; grep -v "^\[afd" "$B/serve.err" | tail -n 3
timeout 120 python3 -m afd bench serve --overhead --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --json "$OUT/overhead.json" \
  2>"$B/overhead.err" | tail -n 3
echo "overhead rc=$?"; grep -v "^\[afd" "$B/overhead.err" | tail -n 5
bench 2a2f 100 --attention 2 --ffn 2 --requests 8 --long-len 1024 --short-len 32 --max-new-tokens 64
# several replicas on one FFN rank (4 PEs on 2 GPUs): the host loop (items batched across replicas) vs a chain of
# passes per replica (AFD_FFN_CHAIN=1), async only
bench 3a1f 100 --attention 3 --ffn 1 --requests 4 --long-len 512 --short-len 32 --max-new-tokens 48 --connectors async
AFD_FFN_CHAIN=1 bench 3a1f_chains 100 --attention 3 --ffn 1 --requests 4 --long-len 512 --short-len 32 \
  --max-new-tokens 48 --connectors async
fi
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
