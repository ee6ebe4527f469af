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

echo "== 3. async on GPU (window protocol version 2)"
for t in "1 1" "2 2"; do
  set -- $t
  timeout 180 python3 -m afd generate "${COMMON[@]}" --json --connector async --attention $1 --ffn $2 \
    >"$OUT/async_${1}a${2}f.json" 2>"$OUT/async_${1}a${2}f.err"; echo "async ${1}A${2}F rc=$?"
done
python3 scripts/compare_outputs.py "$OUT/ref.json" "$OUT"/async_1a1f.json "$OUT"/async_2a2f.json
echo "== leftover processes:"; pgrep -af "afd worker" || echo none
echo "== leftover segments:"; ls /dev/shm | grep afd || echo none
