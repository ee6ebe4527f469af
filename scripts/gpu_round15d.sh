#!/usr/bin/env bash
# Round 15, call d: why async trails p2p at chunked prefill (round 15c: 64 x 512 prompts, 2048-token steps, TTFT p50
# async+sa 524 ms vs p2p 437 ms while its decode step is faster): the per-layer timeline of prefill-only runs of
# that workload (16 steps of 2048 tokens) for async+sa, async and p2p. 7 files come back (at most 8 do).
set -u
source "$(dirname "$0")/device_env.sh"
exec > >(tee -a "$OUT/log.txt") 2>&1
B=/tmp/afd_r15d; mkdir -p "$B"
chunked() {  # chunked NAME ARGS...: the prefill-only run of 64 x 512 with its timeline report
  local name=$1; shift
  export AFD_TIMELINE=$B/$name.tl
  bench "$name" 90 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 1 \
    --no-score "$@"
  unset AFD_TIMELINE
  python3 -m afd.timeline_report "$B/$name.tl" --json "$OUT/${name}_timeline.json"
}
chunked chunked_async_sa --connectors async --shared-experts attention
chunked chunked_async --connectors async
chunked chunked_p2p --connectors p2p
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
