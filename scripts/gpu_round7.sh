#!/usr/bin/env bash
# One device call (nvidia-h200-x2) for the device-side waits of the async connector: the CUDA correctness evidence
# (tiny fp32, every connector vs the reference), the ordering stress test (>= 100,000 messages over NVSHMEM),
# `afd bench exchange`, `afd bench` 1A1F / 2A2F, and the MLA decode launch sweep. At most 8 files come back.
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
EV=/tmp/afd_evidence; mkdir -p "$EV"
OUT=$EV STEP_TIMEOUT=90 bash scripts/gpu_evidence.sh
tar -czf "$OUT/evidence.tar.gz" -C "$EV" .
t0=$SECONDS
timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --stress 60000 --tokens 64 --json "$OUT/stress.json" 2>&1 | tail -n 4
echo "stress rc=$? in $((SECONDS - t0)) s"
t0=$SECONDS
timeout 90 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --json "$OUT/exchange.json" 2>&1 | tail -n 16
echo "bench exchange rc=$? in $((SECONDS - t0)) s"
timeout 150 python3 scripts/gpu_mla_sweep.py >"$OUT/mla_sweep.jsonl" 2>"$OUT/mla_sweep.err"
echo "mla sweep rc=$? $(wc -l <"$OUT/mla_sweep.jsonl") points"; tail -n 2 "$OUT/mla_sweep.err"
python3 scripts/gpu_mla_sweep.py --summary "$OUT/mla_sweep.jsonl"
B=/tmp/afd_bench; mkdir -p "$B"
OUT=$B STEP_TIMEOUT=150 bash scripts/gpu_bench.sh --connectors p2p,async >/dev/null 2>&1
for f in "$B"/*.json; do echo "== $f"; python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
for row in r['runs']:
    print({k: row.get(k) for k in ('connector', 'topology', 'tokens_per_s', 'ttft_p50_s', 'elapsed_s')})
print('numerics', r.get('numerics'))
" "$f" 2>&1 | head; done
tar -czf "$OUT/bench.tar.gz" -C "$B" .
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
