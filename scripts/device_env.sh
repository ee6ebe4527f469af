# Helpers for the device scripts (scripts/gpu_check.sh, scripts/gpu_bench.sh); source it from the repo root:
#   source scripts/device_env.sh
# It installs the carried nvshmem4py wheel (.whl/*.whl) into /tmp/site, puts src/ and it on PYTHONPATH, turns NVLink
# multicast off, and makes $OUT (default /tmp/afd_gpu). The functions write their JSON into $OUT and their stderr into
# $B (set by `log_run`).
OUT=${OUT:-/tmp/afd_gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
# the serving stack imports, or every `afd serve` below would fail at its start: say so at once
SERVE_STACK=ok
python3 -c "import fastapi, uvicorn, pydantic, prometheus_client, aiohttp, tqdm" 2>&1 | tail -n 1 | grep . && {
  SERVE_STACK=missing
  echo "device_env: the serving stack does not import: carry its wheels in .whl/ (docs/performance.md, Tools)" >&2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the model every benchmark runs: DeepSeek-V2-Lite's shapes with seeded random weights, bf16, on CUDA
LITE=(--model deepseek-v2-lite --dtype bfloat16 --device cuda)
# log_run NAME: all the script prints goes to $OUT/log.txt too; its scratch files go to B=/tmp/afd_NAME
log_run() {
  exec > >(tee -a "$OUT/log.txt") 2>&1
  B=/tmp/afd_$1; mkdir -p "$B"
}
# gpus: how many GPUs this machine has
gpus() { nvidia-smi -L | grep -c "^GPU"; }
# leftovers: the afd processes still running (there should be none)
leftovers() {  # (shells whose command line merely names afd, this script's own callers among them, are not)
  echo "== leftover processes:"; pgrep -af "afd" | grep -v -e pgrep -e "bash -c" -e "timeout -k" || echo none; }
# bench NAME LIMIT ARGS...: one `afd bench` (V2-Lite bf16 on CUDA) under a time limit, its JSON into $OUT/NAME.json,
# the table, the status and the last error lines printed
bench() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m afd bench "${LITE[@]}" "$@" --json "$OUT/$name.json" 2>"$B/$name.err" | tail -n 12
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc in $((SECONDS - t0)) s"; grep -v "^\[afd" "$B/$name.err" | tail -n 3
  [[ $rc == 0 ]] || tail -n 60 "$B/$name.err" > "$OUT/$name.err"  # what went wrong comes back
}
# timelined NAME LIMIT ARGS...: `bench` with AFD_TIMELINE on; its report into $OUT/NAME_timeline.json, the raw points
# into $OUT/NAME_points/
timelined() {
  local name=$1
  export AFD_TIMELINE=$B/$name.tl
  bench "$@"
  python3 -m afd.profiling.timeline_report "$AFD_TIMELINE" --json "$OUT/${name}_timeline.json"
  mkdir -p "$OUT/${name}_points" && cp "$AFD_TIMELINE"/*.json "$OUT/${name}_points/"
  unset AFD_TIMELINE
}
# gen NAME ARGS...: one `afd generate` under 180 s, its JSON into ${GEN_DIR:-$OUT}/NAME.json
gen() {
  local name=$1; shift
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-180}" python3 -m afd generate "$@" >"${GEN_DIR:-$OUT}/$name.json" 2>"$B/$name.err"
  echo "$name rc=$? in $((SECONDS - t0)) s"; tail -n 2 "$B/$name.err"
}
# the fp32 oracle's `afd generate` arguments (tiny, 4 prompts, 8 new tokens, prompt logprobs, CUDA);
# scripts/compare_outputs.py compares each run's JSON with the single-process one's
ORACLE=(--model tiny --prompt-ids "5,17,33,2,9,41,7,3,19,23,11;4,8;100,3,77,12,9,250;1" --max-new-tokens 8
  --prompt-logprobs --device cuda --json)
# bench_serve NAME LIMIT ARGS...: `afd bench serve` (V2-Lite bf16 on CUDA) with ARGS (workload, --compare, --rates
# ...), its JSON into $OUT/NAME.json, the table printed
bench_serve() {
  local name=$1 limit=$2; shift 2
  [[ $SERVE_STACK == ok ]] || { echo "$name skipped: the serving stack does not import"; return 1; }
  timeout "$limit" python3 -m afd bench serve "${LITE[@]}" "$@" --json "$OUT/$name.json" 2>"$B/$name.err" | tail -n 12
  local rc=${PIPESTATUS[0]} errors d f
  # requests that failed leave rc 0: their server's last words and the rank logs of a run directory it kept come back
  errors=$(python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
print(sum(run['summary']['errors'] for res in r['results'] for run in res['runs']))" "$OUT/$name.json" 2>/dev/null || echo ?)
  echo "$name rc=$rc, failed requests: $errors"
  if [[ $rc != 0 || $errors != 0 ]]; then
    tail -n 60 "$B/$name.err" > "$OUT/$name.err"
    for d in $(grep -o "/tmp/[^ :'\"]*" "$B/$name.err" | sort -u); do
      [[ -d $d ]] || continue
      for f in "$d"/*.log; do [[ -f $f ]] && tail -n 60 "$f" > "$OUT/$name.$(basename "$f")"; done
    done
  fi
}
# serve_mixed NAME LIMIT ARGS...: `bench_serve` of the mixed workload (64 to 1,024-token prompts, 64 new tokens)
serve_mixed() {
  local name=$1 limit=$2; shift 2
  bench_serve "$name" "$limit" --workload mixed --short-len 64 --long-len 1024 --max-tokens 64 "$@"
}
# front_end NAME: `afd bench serve` of the uniform workload (128-token prompts, 32 new) at 1 request/s through `none`
# R=1, $FRONT_REQUESTS requests (default 32), busy polling unless BUSY_POLL=0; its JSON into $OUT/NAME.json; prints
# the front end's share of TTFT (p50, p90), the part inside the server, and the stages
front_end() {
  local name=$1
  local busy=()  # the flag where this tree has it; an older tree (front_end_ab) reads AFD_BUSY_POLL instead
  [[ ${BUSY_POLL:-1} != 0 ]] && grep -q -- '"--busy-poll"' src/afd/cli/serve.py && busy=(--busy-poll)
  AFD_BUSY_POLL=${BUSY_POLL:-1} timeout 150 python3 -m afd bench serve "${LITE[@]}" "${busy[@]}" --workload uniform \
    --short-len 128 \
    --long-len 128 --max-tokens 32 --requests "${FRONT_REQUESTS:-32}" --rates 1 --compare none:R=1 --warmups 4 \
    --json "$OUT/$name.json" 2>"$B/$name.err" >/dev/null
  echo "$name rc=$?"; grep -v "^\[afd" "$B/$name.err" | grep -iv warn | tail -n 2
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]['runs'][0]; s=r['summary']
print('  front end p50 %.3f ms p90 %.3f ms (in the server p50 %s ms); TTFT p50 %.2f ms; http floor %.3f ms' % (
      s['front_end_p50_s']*1e3, s['front_end_p90_s']*1e3, '%.3f' % (s['server_p50_s']*1e3) if s.get('server_p50_s')
      else '-', s['ttft_p50_s']*1e3, r['http_floor_p50_s']*1e3))
print('  stages p50: ' + ', '.join('%s %.3f' % (k, v*1e3) for k, v in s['ttft_stages_p50_s'].items()))" \
    "$OUT/$name.json"
}
# front_end_ab PAIRS NEW OLD: `front_end` on this tree (runs NEW_1, NEW_2, ...) and on an older one (OLD_1, ...) from
# .whl/old.tar (made here by `git archive COMMIT -- src > .whl/old.tar`), alternated PAIRS times
front_end_ab() {
  local pairs=$1 new=$2 old=$3 i
  mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree
  for ((i = 1; i <= pairs; i++)); do
    front_end "${new}_$i"
    (cd /tmp/old_tree && PYTHONPATH=/tmp/old_tree/src:/tmp/site front_end "${old}_$i")
  done
}
# capacity_ab PAIRS NEW OLD [ARGS]: `none` R=1 at capacity (--rates inf, 16 warm-ups) on this tree (NEW_1, ...) and on
# the older one of .whl/old.tar (OLD_1, ...), alternated PAIRS times; ARGS choose the workload (default: the mixed
# one, $CAPACITY_REQUESTS requests, default 512; a --trace path must be absolute: the older tree runs elsewhere)
capacity_ab() {
  local pairs=$1 new=$2 old=$3 i; shift 3
  local work=("$@")
  (( ${#work[@]} )) || work=(--workload mixed --short-len 64 --long-len 1024 --max-tokens 64
    --requests "${CAPACITY_REQUESTS:-512}")
  local args=("${work[@]}" --compare none:R=1 --rates inf --warmups 16)
  mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree
  for ((i = 1; i <= pairs; i++)); do
    bench_serve "${new}_$i" 240 "${args[@]}"
    (cd /tmp/old_tree && PYTHONPATH=/tmp/old_tree/src:/tmp/site bench_serve "${old}_$i" 240 "${args[@]}")
  done
}
# compiled_while_serving: the Triton compiles the rank logs under $AFD_LOG_DIR saw while serving, and the warm-ups'
# times, into $OUT/compiled_while_serving.txt
compiled_while_serving() {
  grep -h "while serving" "$AFD_LOG_DIR"/*/*.log | sed 's/.*afd.profiling.profiler INFO //' | cut -c1-160 | sort \
    | uniq -c | sort -rn | head -n 20 | tee "$OUT/compiled_while_serving.txt"
  grep -h "warmed up" "$AFD_LOG_DIR"/*/*.log | sed 's/.*INFO //' | tee -a "$OUT/compiled_while_serving.txt"
}
# serve_start LABEL: seconds from `afd serve` (V2-Lite bf16, none R=1) to a healthy /health, then SIGTERM
serve_start() {
  local port=$((8100 + RANDOM % 800)) t0; t0=$(date +%s.%N)
  timeout 300 python3 -m afd serve "${LITE[@]}" --connector none --replicas 1 --port $port \
    >"$B/serve_$1.out" 2>"$B/serve_$1.err" &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "serve $1 died"; tail -n 5 "$B/serve_$1.err"; break; }
    sleep 0.1
  done
  echo "$1: healthy after $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
  kill -TERM $pid; wait $pid; echo "  exit status $?"
}
