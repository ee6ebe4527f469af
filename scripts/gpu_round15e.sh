#!/usr/bin/env bash
# Round 15, call e: the host's share of a chunked-prefill layer (2048-token steps: call d found async's stream
# waiting for its host, host lead ~0.1 ms vs p2p's 1.7 ms). Timeline reports now split the host's time per layer
# (attention, send, up to the reply); the raw points come back too (7 files; at most 8 do).
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
B=/tmp/afd_r15e; mkdir -p "$B"
chunked() {  # chunked NAME ARGS...: the prefill-only run of 64 x 512 with its timeline report and raw points
  local name=$1; shift
  export AFD_TIMELINE=$B/$name.tl
  bench "$name" 90 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 1 \
    --no-score "$@"
  unset AFD_TIMELINE
  python3 -m afd.timeline_report "$B/$name.tl" --json "$OUT/${name}_timeline.json"
  for f in "$B/$name.tl"/*.json; do cp "$f" "$OUT/${name}_points_$(basename "$f")"; done
}
chunked chunked_async_sa --connectors async --shared-experts attention
chunked chunked_p2p --connectors p2p
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
