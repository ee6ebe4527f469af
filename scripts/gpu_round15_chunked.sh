#!/usr/bin/env bash
# Round 15, calls d and e: where chunked prefill goes (64 x 512 prompts, 2048-token steps, prefill only), per-layer
# timelines. `d`: async+sa, async and p2p, the reports only (call d found async's stream waiting for its host: host
# lead ~0.1 ms vs p2p's 1.7 ms). `e` (default): async+sa and p2p, reports with the host's own time per layer and
# the raw points (7 files come back; at most 8 do).
set -u
PHASE=${1:-e}
source "$(dirname "$0")/device_env.sh"
log_run r15$PHASE
chunked() {  # chunked NAME ARGS...: the prefill-only run of 64 x 512 with its timeline report (and points in e)
  local name=$1; shift
  export AFD_TIMELINE=$B/$name.tl
  bench "$name" 90 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 1 \
    --no-score "$@"
  unset AFD_TIMELINE
  python3 -m afd.profiling.timeline_report "$B/$name.tl" --json "$OUT/${name}_timeline.json"
  [[ $PHASE == e ]] && for f in "$B/$name.tl"/*.json; do cp "$f" "$OUT/${name}_points_$(basename "$f")"; done
}
chunked chunked_async_sa --connectors async --shared-experts attention
[[ $PHASE == d ]] && chunked chunked_async --connectors async
chunked chunked_p2p --connectors p2p
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
