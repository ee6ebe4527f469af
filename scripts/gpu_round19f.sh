#!/usr/bin/env bash
# Round 19f (one H200): the front end with busy polling on in the benchmark's client too (its own wake-ups out of
# the measured share), twice.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r19f
export CUDA_VISIBLE_DEVICES=0
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
AFD_BUSY_POLL=1 front_end front_end_bp1_client_spins
AFD_BUSY_POLL=1 front_end front_end_bp1_client_spins_again
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
