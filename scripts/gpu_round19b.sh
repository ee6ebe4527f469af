#!/usr/bin/env bash
# Round 19b (one H200; the x2 kind was not lent). Run as a fresh machine's first call (Triton's disk cache empty).
# 1. Which Triton kernels still compile while serving after the extended warm-up (decode kernels at every split
#    class, a continued prompt beside decodes): `none` R=1 serving the mixed workload with AFD_LOG_DIR, then the
#    rank logs' compile lines (round 19a: 4 MLA decode variants and 1 prefill variant compiled mid-run).
# 2. The front end's share of TTFT at 1 request/s, busy polling off and on, now cut into stages at the server's
#    stamps (`ttft_stages_p50_s`): where the 1.7-2.0 ms of round 19a go.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19b
export CUDA_VISIBLE_DEVICES=0 AFD_LOG_DIR=$B/logs
serve_mixed serve_mixed_none_cold 200 --compare none:R=1 --requests 256 --rates inf --warmups 16
grep -h "while serving" "$AFD_LOG_DIR"/*/*.log | sed 's/.*afd.profiling INFO //' | cut -c1-160 | sort | uniq -c \
  | sort -rn | head -n 20 | tee "$OUT/compiled_while_serving.txt"
grep -h "warmed up" "$AFD_LOG_DIR"/*/*.log | sed 's/.*INFO //' | tee -a "$OUT/compiled_while_serving.txt"
unset AFD_LOG_DIR
for bp in 0 1; do
  AFD_BUSY_POLL=$bp timeout 110 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
    --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --rates 1 --compare none:R=1 \
    --warmups 4 --json "$OUT/front_end_busy_poll_$bp.json" 2>"$B/bp$bp.err" | tail -n 4
  echo "busy_poll=$bp rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/bp$bp.err" | grep -iv warn | tail -n 2
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]['runs'][0]; s=r['summary']
print('front end p50 %.3f ms p90 %.3f ms; TTFT p50 %.2f ms; http floor %.3f ms' % (s['front_end_p50_s']*1e3,
      s['front_end_p90_s']*1e3, s['ttft_p50_s']*1e3, r['http_floor_p50_s']*1e3))
print('  stages p50: ' + ', '.join('%s %.3f ms' % (k, v*1e3) for k, v in s['ttft_stages_p50_s'].items()))" \
    "$OUT/front_end_busy_poll_$bp.json"
done
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
