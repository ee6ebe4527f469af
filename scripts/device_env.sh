# Sourced by the device scripts: the carried nvshmem4py wheel, the repo's sources, NVLink multicast off.
OUT=${OUT:-/tmp/afd_gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# bench NAME LIMIT ARGS...: one `afd bench` (V2-Lite bf16 on CUDA) under a time limit, its JSON into $OUT, its
# stderr into $B (set by the caller), the table, the status and the last error lines printed
bench() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m afd bench --model deepseek-v2-lite --dtype bfloat16 --device cuda "$@" \
    --json "$OUT/$name.json" 2>"$B/$name.err" | tail -n 9
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc in $((SECONDS - t0)) s"; grep -v "^\[afd" "$B/$name.err" | tail -n 3
  [[ $rc == 0 ]] || tail -n 60 "$B/$name.err" > "$OUT/$name.err"  # what went wrong comes back
}
# timelined NAME LIMIT ARGS...: one bench with AFD_TIMELINE on; its report into $OUT/NAME_timeline.json, its raw
# points into $OUT/NAME_points/
timelined() {
  local name=$1
  export AFD_TIMELINE=$B/$name.tl
  bench "$@"
  python3 -m afd.timeline_report "$AFD_TIMELINE" --json "$OUT/${name}_timeline.json"
  mkdir -p "$OUT/${name}_points" && cp "$AFD_TIMELINE"/*.json "$OUT/${name}_points/"
  unset AFD_TIMELINE
}
