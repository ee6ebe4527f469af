#!/usr/bin/env bash
# Issue 9's device checks, run on nvidia-h200-x2 from the repo root with the nvshmem4py wheel in .whl/:
#  1. p2p 1A1F as two hand-started `afd worker`s, one GPU each through CUDA_VISIBLE_DEVICES, vs the reference;
#  2. kill -9 of the FFN rank of a hand-started p2p 1A1F GPU run: the attention rank ends by itself within the
#     timeout and names it (NCCL path: no launcher to notice);
#  3. the async connector (window protocol version 2) on GPU: 1A1F and 2A2F vs the reference.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi -L
PROMPTS="5,17,33,2,9,41,7,3,19,23,11;4,8;100,3,77,12,9,250;1"
COMMON=(--model tiny --prompt-ids "$PROMPTS" --max-new-tokens 8 --prompt-logprobs --device cuda)
timeout 180 python3 -m afd generate "${COMMON[@]}" --json >"$OUT/ref.json" 2>"$OUT/ref.err"; echo "ref rc=$?"

echo "== 1. p2p 1A1F by hand: CUDA_VISIBLE_DEVICES=0 (ffn) and =1 (attention)"
CFG='{"connector": "p2p", "host": "127.0.0.1", "port": 29611, "num_attention_ranks": 1, "num_ffn_ranks": 1, "connector_extra_config": {"timeout_s": 60}}'
CUDA_VISIBLE_DEVICES=0 timeout 180 python3 -m afd worker --config "$CFG" --role ffn --rank 0 --model tiny --device cuda \
  2>"$OUT/hand_ffn.err" &
FFN=$!
CUDA_VISIBLE_DEVICES=1 timeout 180 python3 -m afd worker --config "$CFG" --role attention --rank 0 "${COMMON[@]}" \
  --output "$OUT/hand_p2p.json" 2>"$OUT/hand_attn.err"
echo "attention rc=$?"; wait $FFN; echo "ffn rc=$?"
grep -h "uses GPU" "$OUT"/hand_*.err
python3 scripts/compare_outputs.py "$OUT/ref.json" "$OUT/hand_p2p.json"

echo "== 2. kill -9 the FFN rank of a hand-started p2p 1A1F GPU run (timeout_s 30)"
CFG='{"connector": "p2p", "host": "127.0.0.1", "port": 29612, "num_attention_ranks": 1, "num_ffn_ranks": 1, "connector_extra_config": {"timeout_s": 30}}'
CUDA_VISIBLE_DEVICES=0 python3 -m afd worker --config "$CFG" --role ffn --rank 0 --model tiny --device cuda 2>"$OUT/kill_ffn.err" &
FFN=$!
CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m afd worker --config "$CFG" --role attention --rank 0 --model tiny \
  --device cuda --prompt-ids "1,2,3" --max-new-tokens 4000 2>"$OUT/kill_attn.err" &
ATTN=$!
for _ in $(seq 120); do grep -q "joined a world" "$OUT/kill_attn.err" 2>/dev/null && break; sleep 0.5; done
sleep 5
T0=$(date +%s.%N); kill -9 $FFN
wait $ATTN; RC=$?; T1=$(date +%s.%N)
echo "attention rc=$RC, ended $(python3 -c "print(f'{$T1 - $T0:.1f}')") s after the kill"
grep -v "^\s*$" "$OUT/kill_attn.err" | tail -n 3

echo "== 2b. kill -9 FFN rank 1 (not the store host) of a hand-started p2p 2A2F GPU run: its NCCL peer A1 must name it"
# by hand, one GPU each as afd launch would pack them: F0 and A1 on GPU 0, F1 and A0 on GPU 1
CFG='{"connector": "p2p", "host": "127.0.0.1", "port": 29613, "num_attention_ranks": 2, "num_ffn_ranks": 2, "connector_extra_config": {"timeout_s": 30}}'
W=(python3 -m afd worker --config "$CFG" --model tiny --device cuda)
CUDA_VISIBLE_DEVICES=0 "${W[@]}" --role ffn --rank 0 2>"$OUT/k2_f0.err" & F0=$!
CUDA_VISIBLE_DEVICES=1 "${W[@]}" --role ffn --rank 1 2>"$OUT/k2_f1.err" & F1=$!
CUDA_VISIBLE_DEVICES=1 timeout 120 "${W[@]}" --role attention --rank 0 --prompt-ids "1,2,3" --max-new-tokens 4000 2>"$OUT/k2_a0.err" & A0=$!
CUDA_VISIBLE_DEVICES=0 timeout 120 "${W[@]}" --role attention --rank 1 --prompt-ids "4,5" --max-new-tokens 4000 2>"$OUT/k2_a1.err" & A1=$!
for _ in $(seq 120); do grep -q "joined a world" "$OUT/k2_a1.err" 2>/dev/null && break; sleep 0.5; done
sleep 5
T0=$(date +%s.%N); kill -9 $F1
for p in $A0 $A1 $F0; do wait $p; echo "pid $p rc=$? at +$(python3 -c "import time; print(f'{time.time() - $T0:.1f}')") s"; done
for r in a0 a1 f0; do echo "-- $r:"; grep -E "CRITICAL|ERROR|error" "$OUT/k2_$r.err" | tail -n 2; done

echo "== 3. async on GPU (window protocol version 2)"
for t in "1 1" "2 2"; do
  set -- $t
  timeout 180 python3 -m afd generate "${COMMON[@]}" --json --connector async --attention $1 --ffn $2 \
    >"$OUT/async_${1}a${2}f.json" 2>"$OUT/async_${1}a${2}f.err"; echo "async ${1}A${2}F rc=$?"
done
python3 scripts/compare_outputs.py "$OUT/ref.json" "$OUT"/async_1a1f.json "$OUT"/async_2a2f.json
echo "== leftover processes:"; pgrep -af "afd worker" || echo none
echo "== leftover segments:"; ls /dev/shm | grep afd || echo none
