#!/usr/bin/env bash
# Benchmarks on the device machine: DeepSeek-V2-Lite's shapes (seeded random weights), bf16, on CUDA. Run from the
# repo root with the nvshmem4py wheel carried in .whl/; each run's JSON goes into $OUT, all it prints into
# $OUT/log.txt too. ARGS are added after each subcommand's defaults, so a flag given again overrides its default.
#   bash scripts/gpu_bench.sh SUBCOMMAND [ARGS...]
#   step [ARGS]          one GPU's engine step beside its memory floor (GPU 0):
#                        afd bench step --batch 1,8,64,256 --context 512 --prefill 8x1024
#                        (e.g. `step --contexts 512,3584`: ragged decode rows beside uniform ones at the mean context)
#   step-fp8 [ARGS]      `step` twice in one call, bf16 weights then `--quantization fp8` (same ARGS), and the two side
#                        by side (scripts/compare_steps.py): graph ms of each, fp8/bf16, fp8's floor and graph/floor
#   moe-fp8 [ARGS]       the routed experts alone, bf16 vs FP8 kernels vs FP8 dequantized per call, 26 layers in one
#                        CUDA graph, T = 1,8,64,256 (scripts/gpu_moe_fp8.py; --sweep times FP8 tile shapes too,
#                        --sweep-dequant the experts' dequantization pass over its tile shapes)
#   numerics-fp8 [ARGS]  `--quantization fp8` against the bf16 weights it was made from, V2-Lite on GPU 0: mean / max
#                        |Δp| at bf16's greedy token over 16 x 257 positions, tokens against the same fp8 weights
#                        run dequantized where its top-2 margin is above 1e-2 (scripts/quant_numerics.py), into
#                        $OUT/numerics_fp8.json
#   linear-fp8 [ARGS]    FP8Linear against bf16 F.linear at V2-Lite and V3 linear shapes, M = 1,64,256,8192: ms,
#                        bytes/s, the HBM floor, fp8/bf16, the kernel and the dense path at every M
#                        (scripts/gpu_fp8_linear.py; --models, --rows, --only, --sweep other tile shapes)
#   exchange [ARGS]      one layer's exchange round trip (no-op FFN), 50 passes of 26 layers, async passes replayed
#                        from one CUDA graph, beside a peer copy of the same bytes:
#                        afd bench exchange --iters 50 --layers 26 --graph --tokens 1,8,64,512,4096 --connectors p2p,async
#   stress [N] [T]       ordering under load: N async round trips (default 100000) of random sizes up to T rows
#                        (default 64) through captured passes, every reply checked against its request
#   offline ARGS         `afd bench` (offline, scored against the single-process run) with ARGS, e.g.
#                        --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32
#                        --connectors async,p2p --repeat 3
#   timeline ARGS        `offline` with AFD_TIMELINE on, then `python -m afd.profiling.timeline_report` over it
#   serve [ARGS]         the mixed workload at capacity, then the kernels the ranks compiled while serving:
#                        afd bench serve --workload mixed --short-len 64 --long-len 1024 --max-tokens 64
#                        --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --requests 512 --rates inf --warmups 16
#   front [RUNS]         the front end's share of TTFT at 1 request/s through `none` R=1 on GPU 0, RUNS runs
#                        (default 3) of FRONT_REQUESTS requests (default 32), busy polling unless BUSY_POLL=0
#   front-ab PAIRS       `front` alternated with an older tree (.whl/old.tar: `git archive COMMIT -- src`), PAIRS times
#   capacity-ab [PAIRS] [NAME] [ARGS]  `none` R=1 on GPU 0 at capacity (--rates inf), alternated with the older tree of
#                        .whl/old.tar, PAIRS times (default 3), runs NAME_now_i / NAME_old_i (default NAME: capacity);
#                        ARGS: the workload (default the mixed one, $CAPACITY_REQUESTS requests, default 512), e.g.
#                        `capacity-ab 1 trace --trace $PWD/docs/bench/traces/prefill_heavy.jsonl`
#   step-ab [PAIRS] [ARGS]  `afd bench step` (batch 8, 64, 256 at context 512, prefill 8 x 1024; ARGS added, e.g.
#                        --quantization fp8) on this tree and on the older one of .whl/old.tar, alternated PAIRS times
#                        (default 2), into $OUT/step_{now,old}_I.json
#   fanout-ab [PAIRS] [ARGS]  the front end's fan-out (scripts/front_end_fanout.py --streams 1024 --max-tokens 64
#                        --step-ms 20, no GPU) on this tree and on the older one of .whl/old.tar, alternated PAIRS
#                        times (default 3), into $OUT/fanout.jsonl (a "tree" key: now / old)
#   startup [RUNS]       seconds from `afd serve` (`none` R=1, GPU 0) to a healthy /health, RUNS times (default 2) after
#                        one start that fills Triton's cache
#   kernels              the MLA decode launch sweep, and the step's numerics against eager PyTorch ops
#   cross-replica [ARGS] two attention replicas' rows in one expert pass against one's (scripts/gpu_cross_replica.py)
#   host [ARGS]          where the attention rank's host time goes in steps with prompt tokens: eager and graphed
#                        forwards' host vs device ms, a cProfile of the mixed step, each core op's launch cost back to
#                        back and alone (scripts/host_profile.py), into $OUT/host_profile.{txt,json}
#   validate [COMPARE] [ARGS]  the served runs `afd simulate --compare` checks a profile against: the mixed and the
#                        uneven workload (64 to 1,024-token prompts, 64 new tokens, 512 requests) at rates inf, 64
#                        and 16 per s through COMPARE (default none:R=1), into $OUT/validation_{mixed,uneven}.json
#   profile [ARGS]       afd profile --model deepseek-v2-lite --device cuda (decode/prefill steps on GPU 0, experts,
#                        both exchanges 1A1F) into $OUT/profile_h200.json, the profile docs/planning.md asks for
#   profile-validate     `profile` and then `validate none:R=1,async:A=1,F=1` in one call (~8 min on one H200), so
#                        that the profile and the served runs it is checked against share a machine: capacity moved
#                        ~10% between calls of one session; `afd simulate --compare` picks each server from the files
set -u
cd "$(dirname "$0")/.."
source scripts/device_env.sh
SUB=${1:-}; shift || true
# validation_runs LIMIT COMPARE [ARGS]: the mixed and uneven workloads served through COMPARE, into
# $OUT/validation_{mixed,uneven}.json, each under LIMIT seconds
validation_runs() {
  local limit=$1 compare=$2 w; shift 2
  for w in mixed uneven; do
    bench_serve "validation_$w" "$limit" --workload $w --short-len 64 --long-len 1024 --max-tokens 64 --requests 512 \
      --compare "$compare" --rates inf,64,16 --warmups 16 "$@"
  done
}
case $SUB in
  step|step-fp8|moe-fp8|numerics-fp8|linear-fp8|exchange|stress|offline|timeline|serve|front|front-ab|capacity-ab|step-ab|fanout-ab|startup|kernels|cross-replica|host|validate|profile|profile-validate) ;;
  *) echo "usage: bash scripts/gpu_bench.sh step|step-fp8|moe-fp8|numerics-fp8|linear-fp8|exchange|stress|offline|timeline|serve|front|front-ab|capacity-ab|step-ab|fanout-ab|startup|kernels|cross-replica|host|validate|profile|profile-validate [ARGS...]" >&2
    exit 2 ;;
esac
log_run "bench_${SUB:-none}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

case $SUB in
  step)
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m afd bench step "${LITE[@]}" --batch 1,8,64,256 --context 512 \
      --prefill 8x1024 "$@" --json "$OUT/step.json" 2>"$B/step.err" | tail -n 12
    echo "step rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/step.err" | tail -n 3 ;;
  step-fp8)
    for q in bf16 fp8; do
      extra=(); [[ $q == fp8 ]] && extra=(--quantization fp8)
      CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m afd bench step "${LITE[@]}" --batch 8,64,256 --context 512 \
        --prefill 8x1024 "${extra[@]}" "$@" --json "$OUT/step_$q.json" 2>"$B/step_$q.err" | tail -n 12
      echo "step $q rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/step_$q.err" | tail -n 3
    done
    python3 scripts/compare_steps.py "$OUT/step_bf16.json" "$OUT/step_fp8.json" | tee "$OUT/step_fp8_vs_bf16.txt" ;;
  moe-fp8)
    CUDA_VISIBLE_DEVICES=0 timeout 500 python3 scripts/gpu_moe_fp8.py "$@" | tee "$OUT/moe_fp8.jsonl" ;;
  numerics-fp8)
    CUDA_VISIBLE_DEVICES=0 timeout 400 python3 scripts/quant_numerics.py "$@" --json "$OUT/numerics_fp8.json" \
      2>"$B/numerics_fp8.err"
    echo "numerics-fp8 rc=$?"; grep -v "^\[afd" "$B/numerics_fp8.err" | tail -n 3 ;;
  linear-fp8)
    CUDA_VISIBLE_DEVICES=0 timeout 560 python3 scripts/gpu_fp8_linear.py "$@" >"$OUT/linear_fp8.jsonl" \
      2>"$OUT/linear_fp8.txt"
    echo "linear-fp8 rc=$?"; tail -n 80 "$OUT/linear_fp8.txt" ;;
  exchange)
    timeout 300 python3 -m afd bench exchange "${LITE[@]}" --iters 50 --layers 26 --graph --tokens 1,8,64,512,4096 \
      --connectors p2p,async "$@" --json "$OUT/exchange.json" 2>"$B/exchange.err" | tail -n 14
    echo "exchange rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/exchange.err" | grep -iv warn | tail -n 3 ;;
  stress)
    timeout 300 python3 -m afd bench exchange "${LITE[@]}" --stress "${1:-100000}" --graph --tokens "${2:-64}" \
      --json "$OUT/stress.json" 2>"$B/stress.err" | tail -n 2
    echo "stress rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/stress.err" | grep -iv warn | tail -n 3 ;;
  offline)
    bench offline 560 "$@" ;;
  timeline)
    timelined offline 560 "$@" ;;
  serve)
    export AFD_LOG_DIR=$B/logs
    serve_mixed serve_mixed 560 --compare none:R=2,p2p:A=1,F=1,async:A=1,F=1 --requests 512 --rates inf \
      --warmups 16 "$@"
    compiled_while_serving
    unset AFD_LOG_DIR ;;
  front)
    export CUDA_VISIBLE_DEVICES=0
    for ((i = 1; i <= ${1:-3}; i++)); do front_end "front_$i"; done ;;
  front-ab)
    export CUDA_VISIBLE_DEVICES=0
    front_end_ab "${1:-2}" front_now front_old ;;
  capacity-ab)
    export CUDA_VISIBLE_DEVICES=0
    name=${2:-capacity}
    capacity_ab "${1:-3}" "${name}_now" "${name}_old" "${@:3}" ;;
  step-ab)
    mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree
    for ((i = 1; i <= ${1:-2}; i++)); do
      for tree in now old; do
        src=src; [[ $tree == old ]] && src=/tmp/old_tree/src
        echo "== tree $tree, pass $i"
        CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$src:/tmp/site timeout 150 python3 -m afd bench step "${LITE[@]}" \
          --batch 8,64,256 --context 512 --prefill 8x1024 "${@:2}" --json "$OUT/step_${tree}_$i.json" \
          2>"$B/step_${tree}_$i.err" | tail -n 7
      done
    done ;;
  fanout-ab)
    mkdir -p /tmp/old_tree && tar -xf .whl/old.tar -C /tmp/old_tree
    for ((i = 1; i <= ${1:-3}; i++)); do
      for tree in now old; do
        src=src; [[ $tree == old ]] && src=/tmp/old_tree/src
        PYTHONPATH=$src:/tmp/site timeout 120 python3 scripts/front_end_fanout.py --streams 1024 --max-tokens 64 \
          --step-ms 20 "${@:2}" 2>>"$B/fanout.err" | sed "s/^{/{\"tree\": \"$tree\", /" | tee -a "$OUT/fanout.jsonl"
      done
    done ;;
  startup)
    export CUDA_VISIBLE_DEVICES=0 AFD_LOG_DIR=$B/logs
    serve_start cache_fill
    for ((i = 1; i <= ${1:-2}; i++)); do serve_start "start_$i"; done
    grep -h "warmed up" "$AFD_LOG_DIR"/*/*.log | sed 's/^.* afd\./afd./' | cut -c1-150 | tee "$OUT/warm_up_lines.txt"
    unset AFD_LOG_DIR ;;
  kernels)
    export CUDA_VISIBLE_DEVICES=0
    timeout 200 python3 scripts/gpu_mla_sweep.py >"$OUT/mla_sweep.jsonl" 2>>"$B/kernels.err" || echo "mla sweep rc=$?"
    python3 scripts/gpu_mla_sweep.py --summary "$OUT/mla_sweep.jsonl"
    timeout 200 python3 scripts/gpu_kernel_numerics.py >"$OUT/step_numerics.jsonl" 2>>"$B/kernels.err" \
      || echo "numerics rc=$?" ;;
  cross-replica)
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/gpu_cross_replica.py "$@" | tee "$OUT/cross_replica.jsonl" ;;
  host)
    CUDA_VISIBLE_DEVICES=0 timeout 400 python3 scripts/host_profile.py "$OUT" "$@" ;;
  validate)
    validation_runs 280 "${1:-none:R=1}" "${@:2}" ;;
  profile)
    timeout 560 python3 -m afd profile --model deepseek-v2-lite --device cuda --dtype bfloat16 \
      -o "$OUT/profile_h200.json" "$@" ;;
  profile-validate)
    timeout 240 python3 -m afd profile --model deepseek-v2-lite --device cuda --dtype bfloat16 \
      -o "$OUT/profile_h200.json" > "$OUT/profile_log.txt" 2>&1
    echo "profile rc=$? at $SECONDS s"; tail -n 14 "$OUT/profile_log.txt"
    validation_runs 300 none:R=1,async:A=1,F=1 ;;
esac
leftovers
