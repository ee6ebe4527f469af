#!/usr/bin/env bash
# Round 18d (nvidia-h200-x2, GPU 0 only, the session's last ~4 minutes of device time): the front end's share of
# TTFT (issue 12: <= 1 ms p50 at 1 request/s) without and with AFD_BUSY_POLL=1 (the front end's loop and the idle
# replica poll without sleeping). The share is measured inside each server's run: client TTFT minus the replica's
# own time to the first token, request by request.
set -u
source "$(dirname "$0")/device_env.sh"
log_run r18d
export CUDA_VISIBLE_DEVICES=0
for bp in 0 1; do
  AFD_BUSY_POLL=$bp timeout 110 python3 -m afd bench serve --model deepseek-v2-lite --dtype bfloat16 --device cuda \
    --workload uniform --short-len 128 --long-len 128 --max-tokens 32 --requests 24 --rates 1 --compare none:R=1 \
    --warmups 4 --json "$OUT/front_end_busy_poll_$bp.json" 2>"$B/bp$bp.err" | tail -n 3
  echo "busy_poll=$bp rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/bp$bp.err" | grep -iv warn | tail -n 2
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]['runs'][0]; s=r['summary']
print('front end p50 %.2f ms p90 %.2f ms; TTFT p50 %.1f ms; http floor %s' % (s['front_end_p50_s']*1e3,
      s['front_end_p90_s']*1e3, s['ttft_p50_s']*1e3, r.get('http_floor_p50_s')))" "$OUT/front_end_busy_poll_$bp.json"
done
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
