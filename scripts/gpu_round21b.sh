#!/usr/bin/env bash
# Round 21b (one H200, ~3 minutes): start-up times with forked ranks against processes of their own, alternated (call
# 21a ran the forked server first, on an empty Triton cache). The first server start only fills the cache.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r21b
export CUDA_VISIBLE_DEVICES=0
export AFD_LOG_DIR=$B/logs
serve_start 0 cache_fill
for i in 1 2; do serve_start 1 "forked_$i"; serve_start 0 "own_$i"; done
grep -h "warmed up\|loaded" "$AFD_LOG_DIR"/*/*.log | sed 's/^.* afd\./afd./' | cut -c1-150 | tee "$OUT/warm_up_lines.txt"
echo "== afd launch, tiny on CUDA, async 1A2F (wall s)"
for z in 1 0 1 0; do
  t0=$(date +%s.%N)
  AFD_ZYGOTE=$z timeout 120 python3 -m afd launch --model tiny --device cuda --connector async --attention 1 --ffn 2 \
    --prompt-ids "1,2,3;4,5" --max-new-tokens 4 >/dev/null 2>"$B/launch.err" || tail -n 5 "$B/launch.err"
  echo "AFD_ZYGOTE=$z: $(python3 -c "import time; print(round(time.time() - $t0, 2))") s"
done
python3 -c "import time,torch; t=time.time(); import torch.nn; print('import torch (again, cached):', torch.__version__)"
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
