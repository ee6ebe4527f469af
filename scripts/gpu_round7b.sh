#!/usr/bin/env bash
# Device call (nvidia-h200-x2): the fused router's GPU tests and timing, the CUDA evidence (async 2A2F waits through
# cuStreamWaitValue64: two ranks per GPU), the MLA sweep inside CUDA graphs, `afd bench` 2A2F. At most 8 files back.
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 240 python3 -m pytest -q tests/test_kernel_router.py -m gpu -p no:cacheprovider 2>&1 | tail -n 6
timeout 120 python3 tests/test_kernel_router.py bench >"$OUT/router_bench.jsonl" 2>&1; echo "router bench rc=$?"
cat "$OUT/router_bench.jsonl" | head -n 24
EV=/tmp/afd_evidence; mkdir -p "$EV"
OUT=$EV STEP_TIMEOUT=90 bash scripts/gpu_evidence.sh
tar -czf "$OUT/evidence.tar.gz" -C "$EV" .
timeout 150 python3 scripts/gpu_mla_sweep.py >"$OUT/mla_sweep.jsonl" 2>"$OUT/mla_sweep.err"
echo "mla sweep rc=$? $(wc -l <"$OUT/mla_sweep.jsonl") points"; tail -n 2 "$OUT/mla_sweep.err"
python3 scripts/gpu_mla_sweep.py --summary "$OUT/mla_sweep.jsonl"
B=/tmp/afd_bench; mkdir -p "$B"
source "$(dirname "$0")/device_env.sh"
OUT=$B timeout 200 python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda --attention 2 --ffn 2 \
  --requests 8 --long-len 1024 --short-len 32 --max-new-tokens 64 --json "$B/lite_bf16_2a2f.json" 2>"$B/2a2f.err" | tail -n 8
echo "afd bench 2a2f rc=$?"; tail -n 3 "$B/2a2f.err"
tar -czf "$OUT/bench.tar.gz" -C "$B" .
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
