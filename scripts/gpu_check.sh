#!/usr/bin/env bash
# Correctness on the device machine, from the repo root, with the nvshmem4py wheel carried in .whl/; results into $OUT.
#   bash scripts/gpu_check.sh [tests|oracle|sweep|faults|isolation|all] [ARGS...]
#   tests [PYTEST ARGS]  the `gpu`-marked tests (`pytest -m gpu`, default over tests/), output in $OUT/gpu_tests.txt
#   oracle               the fp32 oracle: `afd generate --model tiny ... --prompt-logprobs` on CUDA as one process (the
#                        reference), then async 1A1F (one and two micro-batches), 1A2F or 2A2F, prompts in chunks of
#                        8 tokens, and with two GPUs p2p 1A1F and 2A2F; each compared with the reference by
#                        scripts/compare_outputs.py (tokens equal, max |Δ logprob| <= 1e-4) into $OUT/compare.txt
#   sweep ["RUNS"]       scripts/topology_sweep.sh on CUDA (default: the topologies two GPUs hold) into $OUT/sweep
#   faults               two GPUs: p2p 1A1F as two hand-started `afd worker`s, then kill -9 of an FFN rank of a
#                        hand-started p2p 1A1F and 2A2F run: the other ranks must stop by themselves and name it
#   isolation [SECONDS]  `afd serve` none R=2 co-located on GPU 0 under the mixed workload (10 requests/s), replica 1
#                        killed after SECONDS of load: failed requests, time until /health is "ok" again
#   all                  tests, then oracle (the default)
# Exit status: that of the last check (compare_outputs.py's for the oracle).
set -u
cd "$(dirname "$0")/.."
source scripts/device_env.sh
log_run check
CHECK=${1:-all}; shift || true
nvidia-smi -L
python3 -c "import torch, nvshmem.core; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

run_tests() {
  local t0=$SECONDS
  timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf "${@:-tests/}" \
    >"$OUT/gpu_tests.txt" 2>&1
  local rc=$?
  echo "gpu tests rc=$rc in $((SECONDS - t0)) s"; tail -n 12 "$OUT/gpu_tests.txt"
  return $rc
}

run_oracle() {
  export GEN_DIR=$OUT
  local runs=() m2='{"connector_extra_config": {"async_moe_ubatching": true}}'
  gen ref "${ORACLE[@]}"
  gen async_1a1f "${ORACLE[@]}" --connector async --attention 1 --ffn 1; runs+=(async_1a1f)
  gen async_1a1f_m2 "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --config "$m2"; runs+=(async_1a1f_m2)
  gen async_1a1f_budget8 "${ORACLE[@]}" --connector async --attention 1 --ffn 1 --max-num-batched-tokens 8
  runs+=(async_1a1f_budget8)
  if (( $(gpus) >= 2 )); then  # NCCL cannot hold two ranks of one communicator on one GPU
    gen async_2a2f "${ORACLE[@]}" --connector async --attention 2 --ffn 2; runs+=(async_2a2f)
    gen p2p_1a1f "${ORACLE[@]}" --connector p2p --attention 1 --ffn 1; runs+=(p2p_1a1f)
    gen p2p_2a2f "${ORACLE[@]}" --connector p2p --attention 2 --ffn 2; runs+=(p2p_2a2f)
    gen p2p_1a1f_budget8 "${ORACLE[@]}" --connector p2p --attention 1 --ffn 1 --max-num-batched-tokens 8
    runs+=(p2p_1a1f_budget8)
  else  # NVSHMEM wants the same number of PEs on every GPU: one GPU holds any count
    gen async_1a2f "${ORACLE[@]}" --connector async --attention 1 --ffn 2; runs+=(async_1a2f)
  fi
  local paths=() name
  for name in "${runs[@]}"; do paths+=("$OUT/$name.json"); done
  python3 scripts/compare_outputs.py "$OUT/ref.json" "${paths[@]}" | sed "s|^$OUT/||" | tee "$OUT/compare.txt"
  return "${PIPESTATUS[0]}"
}

run_sweep() {
  STEP_TIMEOUT=${STEP_TIMEOUT:-75} bash scripts/topology_sweep.sh cuda \
    "${1:-p2p:2x2 async:3x1 async:1x3 async:4x4 async:6x2 async:2x6}" "$OUT/sweep" | tee "$OUT/sweep.txt"
}

# wait_joined FILE: until the rank logging to FILE has joined its world (at most 60 s)
wait_joined() { for _ in $(seq 120); do grep -q "joined a world" "$1" 2>/dev/null && return; sleep 0.5; done; }

run_faults() {
  (( $(gpus) >= 2 )) || { echo "faults: needs two GPUs"; return 1; }
  local common=(--model tiny --prompt-ids "5,17,33,2,9,41,7,3,19,23,11;4,8;100,3,77,12,9,250;1" --max-new-tokens 8
    --prompt-logprobs --device cuda) cfg w ffn attn f0 f1 a0 a1 t0 p r
  timeout 180 python3 -m afd generate "${common[@]}" --json >"$B/ref.json" 2>"$B/ref.err"; echo "ref rc=$?"

  echo "== p2p 1A1F by hand: CUDA_VISIBLE_DEVICES=0 (ffn) and =1 (attention)"
  cfg='{"connector": "p2p", "host": "127.0.0.1", "port": 29611, "num_attention_ranks": 1, "num_ffn_ranks": 1,
    "connector_extra_config": {"timeout_s": 60}}'
  CUDA_VISIBLE_DEVICES=0 timeout 180 python3 -m afd worker --config "$cfg" --role ffn --rank 0 --model tiny \
    --device cuda 2>"$B/hand_ffn.err" & ffn=$!
  CUDA_VISIBLE_DEVICES=1 timeout 180 python3 -m afd worker --config "$cfg" --role attention --rank 0 "${common[@]}" \
    --output "$B/hand_p2p.json" 2>"$B/hand_attn.err"
  echo "attention rc=$?"; wait $ffn; echo "ffn rc=$?"
  grep -h "uses GPU" "$B"/hand_*.err
  python3 scripts/compare_outputs.py "$B/ref.json" "$B/hand_p2p.json" | sed "s|^$B/||"

  echo "== kill -9 the FFN rank (the store host) of a hand-started p2p 1A1F run, timeout_s 30"
  cfg='{"connector": "p2p", "host": "127.0.0.1", "port": 29612, "num_attention_ranks": 1, "num_ffn_ranks": 1,
    "connector_extra_config": {"timeout_s": 30}}'
  CUDA_VISIBLE_DEVICES=0 python3 -m afd worker --config "$cfg" --role ffn --rank 0 --model tiny --device cuda \
    2>"$B/kill_ffn.err" & ffn=$!
  CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m afd worker --config "$cfg" --role attention --rank 0 --model tiny \
    --device cuda --prompt-ids "1,2,3" --max-new-tokens 4000 2>"$B/kill_attn.err" & attn=$!
  wait_joined "$B/kill_attn.err"; sleep 5
  t0=$(date +%s.%N); kill -9 $ffn
  wait $attn; r=$?
  echo "attention rc=$r, ended $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s after the kill"
  grep -v "^\s*$" "$B/kill_attn.err" | tail -n 1

  echo "== kill -9 FFN rank 1 (not the store host) of a hand-started p2p 2A2F run: the others must name it"
  cfg='{"connector": "p2p", "host": "127.0.0.1", "port": 29613, "num_attention_ranks": 2, "num_ffn_ranks": 2,
    "connector_extra_config": {"timeout_s": 30}}'
  w=(python3 -m afd worker --config "$cfg" --model tiny --device cuda)
  # one GPU each as `afd launch` packs them: F0 and A1 on GPU 0, F1 and A0 on GPU 1
  CUDA_VISIBLE_DEVICES=0 "${w[@]}" --role ffn --rank 0 2>"$B/k2_f0.err" & f0=$!
  CUDA_VISIBLE_DEVICES=1 "${w[@]}" --role ffn --rank 1 2>"$B/k2_f1.err" & f1=$!
  CUDA_VISIBLE_DEVICES=1 timeout 120 "${w[@]}" --role attention --rank 0 --prompt-ids "1,2,3" --max-new-tokens 4000 \
    2>"$B/k2_a0.err" & a0=$!
  CUDA_VISIBLE_DEVICES=0 timeout 120 "${w[@]}" --role attention --rank 1 --prompt-ids "4,5" --max-new-tokens 4000 \
    2>"$B/k2_a1.err" & a1=$!
  wait_joined "$B/k2_a1.err"; sleep 5
  t0=$(date +%s.%N); kill -9 $f1
  for p in $a0 $a1 $f0; do
    wait $p; echo "pid $p rc=$? at +$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
  done
  for r in a0 a1 f0; do echo "-- $r:"; grep -E "CRITICAL|ERROR" "$B/k2_$r.err" | tail -n 1; done
  echo "== leftover segments:"; ls /dev/shm | grep afd || echo none
}

# run_isolation [SECONDS]: `afd serve` none R=2 co-located on GPU 0 (V2-Lite bf16) under the mixed workload at 10
# requests/s through `afd bench serve --url`; replica 1 is killed (kill -9) after SECONDS (default 6) of load. Prints
# the requests that failed, how long /health took to say "ok" with replica 1 restarted, and the bench's table.
run_isolation() {
  local port=$((8100 + RANDOM % 800)) url pid victim t_kill
  url=http://127.0.0.1:$port
  CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m afd serve "${LITE[@]}" --connector none --replicas 2 --port $port \
    >"$B/isolation_serve.out" 2>"$B/isolation_serve.err" &
  pid=$!
  for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && break; sleep 0.5; done
  curl -s "$url/health"; echo
  timeout 300 python3 -m afd bench serve --url "$url" --workload mixed --short-len 64 --long-len 1024 --max-tokens 64 \
    --requests 300 --rates 10 --json "$OUT/isolation_bench.json" >"$OUT/isolation_bench.txt" 2>"$B/isolation_bench.err" &
  local bench=$!
  sleep "${1:-6}"
  victim=$(pgrep -f "afd worker.*--role replica --rank 1" | head -n 1)
  t_kill=$(date +%s.%N); kill -9 "$victim"; echo "killed replica 1 (pid $victim)"
  until curl -s "$url/health" | python3 -c "import json,sys; h=json.load(sys.stdin)
sys.exit(0 if h['status'] == 'ok' and h['replicas'][1]['restarts'] >= 1 else 1)" 2>/dev/null; do
    (( $(date +%s) - ${t_kill%.*} > 120 )) && { echo "not whole within 120 s"; break; }
    sleep 0.1
  done
  echo "whole again after $(python3 -c "import time; print(round(time.time() - $t_kill, 2))") s: $(curl -s "$url/health")"
  wait $bench; echo "bench rc=$?"; cat "$OUT/isolation_bench.txt"; grep -v "^\[afd" "$B/isolation_bench.err" | tail -n 3
  kill -TERM $pid; wait $pid; echo "serve exit status $?"
  grep -h "replica 1\|restart" "$B/isolation_serve.err" | tail -n 5
}

case $CHECK in
  tests) run_tests "$@" ;;
  oracle) run_oracle ;;
  sweep) run_sweep "$@" ;;
  faults) run_faults ;;
  isolation) run_isolation "$@" ;;
  all) run_tests; run_oracle ;;
  *) echo "usage: bash scripts/gpu_check.sh [tests|oracle|sweep|faults|isolation|all] [ARGS...]" >&2; exit 2 ;;
esac
rc=$?
leftovers
exit $rc
