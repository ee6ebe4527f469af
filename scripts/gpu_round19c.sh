#!/usr/bin/env bash
# Round 19c (one H200; the x2 kind was not lent). Run as a fresh machine's first call (Triton's disk cache empty).
# 1. Triton kernels compiled while serving after round 19b's fixes: the MoE kernels at every routed variant
#    (`moe.warm_up_token_counts`) on a whole-model replica too, the prefill's key-length table always 16-byte
#    aligned. `none` R=1 serving the mixed workload with AFD_LOG_DIR, then the rank logs' compile lines.
# 2. The front end's share of TTFT at 1 request/s, cut into stages, with busy polling on: asyncio's loop against
#    uvloop (AFD_UVLOOP=0/1; the wheel is carried), and uvloop without busy polling.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19c
export CUDA_VISIBLE_DEVICES=0 AFD_LOG_DIR=$B/logs
serve_mixed serve_mixed_none_cold 200 --compare none:R=1 --requests 256 --rates inf --warmups 16
grep -h "while serving" "$AFD_LOG_DIR"/*/*.log | sed 's/.*afd.profiling INFO //' | cut -c1-160 | sort | uniq -c \
  | sort -rn | head -n 20 | tee "$OUT/compiled_while_serving.txt"
grep -h "warmed up" "$AFD_LOG_DIR"/*/*.log | sed 's/.*INFO //' | tee -a "$OUT/compiled_while_serving.txt"
unset AFD_LOG_DIR
python3 -c "import uvloop; print('uvloop', uvloop.__version__)"
front_end() {  # front_end NAME: the uniform workload at 1 request/s through `none` R=1, front end share and stages
  local name=$1
  timeout 110 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
    --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --rates 1 --compare none:R=1 \
    --warmups 4 --json "$OUT/$name.json" 2>"$B/$name.err" >/dev/null
  echo "$name rc=$?"; grep -v "^\[afd" "$B/$name.err" | grep -iv warn | tail -n 2
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]['runs'][0]; s=r['summary']
print('  front end p50 %.3f ms p90 %.3f ms; TTFT p50 %.2f ms; http floor %.3f ms' % (s['front_end_p50_s']*1e3,
      s['front_end_p90_s']*1e3, s['ttft_p50_s']*1e3, r['http_floor_p50_s']*1e3))
print('  stages p50: ' + ', '.join('%s %.3f' % (k, v*1e3) for k, v in s['ttft_stages_p50_s'].items()))" \
    "$OUT/$name.json"
}
AFD_BUSY_POLL=1 AFD_UVLOOP=0 front_end front_end_bp1_asyncio
AFD_BUSY_POLL=1 AFD_UVLOOP=1 front_end front_end_bp1_uvloop
AFD_BUSY_POLL=0 AFD_UVLOOP=1 front_end front_end_bp0_uvloop
AFD_BUSY_POLL=1 AFD_UVLOOP=0 front_end front_end_bp1_asyncio_again
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
