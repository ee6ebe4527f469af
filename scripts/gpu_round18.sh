#!/usr/bin/env bash
# Round 18 (nvidia-h200-x2, one call of under 9 minutes): the fused exchange kernels (issue 11: exchange <= 25 us).
# The attention side's send is one launch (rows, ids, weights, header, flag: `send_request`), the FFN item's reply
# and bookkeeping one (`reply_item`), and the FFN's device chain replays one graph per whole pass. In order: the
# kernel tests on the GPU and the captured-steps test; the exchange at T = 1, 8, 64 with whole-pass graphs and
# without (AFD_FFN_PASS_GRAPHS=0), p2p beside; the fp32 oracle (captured decode steps send with the new kernel);
# the 1A1F decode row (bf16 numerics scored; the FFN chain serves it); serving 1A1F last (it may be cut short).
set -u
source "$(dirname "$0")/device_env.sh"
log_run r18
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/test_chain_kernels.py \
  tests/test_ffn_chain.py 2>&1 | tail -n 8
xbench() {  # xbench NAME ARGS...: `afd bench exchange` (V2-Lite shapes, bf16, 26 layers per pass)
  local name=$1; shift
  timeout 120 python3 -m afd bench exchange --model deepseek-v2-lite --dtype bfloat16 --device cuda --iters 50 \
    --layers 26 "$@" --json "$OUT/$name.json" 2>"$B/$name.err" | tail -n 5
  echo "$name rc=${PIPESTATUS[0]}"; grep -v "^\[afd" "$B/$name.err" | grep -iv warn | tail -n 2
}
xbench exchange_graph --tokens 1,8,64 --graph --connectors async
AFD_FFN_PASS_GRAPHS=0 xbench exchange_graph_layer_graphs --tokens 1,8,64 --graph --connectors async
xbench exchange_p2p --tokens 1,8,64 --connectors p2p
export GEN_DIR=$B
AFD_PREFILL_GRAPHS=0 gen ref "${ORACLE[@]}"
gen async_1a1f "${ORACLE[@]}" --connector async --attention 1 --ffn 1
python3 scripts/compare_outputs.py "$B/ref.json" "$B"/async_1a1f.json | tee "$OUT/compare.txt"
bench decode_1a1f 170 --attention 1 --ffn 1 --requests 64 --long-len 512 --short-len 512 --max-new-tokens 32 \
  --connectors async,p2p
grep -h "work items served on the device" "$B"/decode_1a1f.err | tail -n 1
serve_mixed serve_mixed_1a1f_512 130 --compare p2p:A=1,F=1,async:A=1,F=1 --requests 512 --rates inf --warmups 16
echo "== leftover processes:"; pgrep -af "afd" | grep -v pgrep || echo none
