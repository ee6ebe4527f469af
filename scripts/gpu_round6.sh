#!/usr/bin/env bash
# One device call (nvidia-h200-x2) after the wire-v3 / fused-p2p / serve changes: the CUDA correctness evidence
# (tiny, fp32, every connector vs the reference), `afd bench serve` on the `mixed` workload (none R=2 vs p2p 1A1F vs
# async 1A1F on the same two GPUs), and `afd bench exchange`. At most 8 files come back: the evidence is one tarball.
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
EV=/tmp/afd_evidence; mkdir -p "$EV"
OUT=$EV STEP_TIMEOUT=60 bash scripts/gpu_evidence.sh
tar -czf "$OUT/evidence.tar.gz" -C "$EV" .
t0=$SECONDS
timeout 270 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --workload mixed --requests 48 --rates 4,16,64 \
  --short-len 64 --long-len 1024 --max-tokens 64 --json "$OUT/serve_mixed.json" 2>"$OUT/serve_mixed.err" | tail -n 14
echo "bench serve rc=$? in $((SECONDS - t0)) s"; tail -n 3 "$OUT/serve_mixed.err"
t0=$SECONDS
timeout 70 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda \
  --json "$OUT/exchange.json" 2>&1 | tail -n 16
echo "bench exchange rc=$? in $((SECONDS - t0)) s"
