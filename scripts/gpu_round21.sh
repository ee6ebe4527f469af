#!/usr/bin/env bash
# Round 21 (one H200, ~6 minutes): ranks forked from the launch's zygote (afd.runtime.zygote) on CUDA.
# 1. The fp32 oracle: single process against async 1A1F and 1A2F (every PE on the one GPU), forked ranks.
# 2. Start-up time of `afd launch` (tiny, CUDA) and of `afd serve` (V2-Lite bf16) to a healthy server, forked
#    ranks against processes of their own (AFD_ZYGOTE=0), side by side in this call.
# 3. The front end's share of TTFT at 1 request/s (two runs), now that the replica is a forked rank.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r21
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"
gen ref "${ORACLE[@]}"
gen async_1a1f "${ORACLE[@]}" --connector async --attention 1 --ffn 1
gen async_1a2f "${ORACLE[@]}" --connector async --attention 1 --ffn 2
python3 scripts/compare_outputs.py "$OUT/ref.json" "$OUT"/async_1a1f.json "$OUT"/async_1a2f.json
echo "== afd launch start-up, tiny on CUDA (wall s)"
for z in 1 0 1 0; do
  /usr/bin/time -f "AFD_ZYGOTE=$z launch async 1A2F: %e s wall, %U s user" env AFD_ZYGOTE=$z timeout 120 python3 -m afd \
    launch --model tiny --device cuda --connector async --attention 1 --ffn 2 --prompt-ids "1,2,3;4,5" \
    --max-new-tokens 4 >/dev/null 2>"$B/launch_$z.err" || tail -n 5 "$B/launch_$z.err"
done
echo "== afd serve start-up to a healthy /health, V2-Lite bf16 (s)"
for z in 1 0; do serve_start $z "zygote_$z"; done
for i in 1 2; do AFD_BUSY_POLL=1 front_end front_end_bp1_zygote_$i; done
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
