"""`afd plan --decode-only`: a decode cluster's steady state (prompts prefilled elsewhere), scored without the
simulator: each replica at the largest batch its cache holds and the TPOT bound allows."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers.cli import main_exit

from afd.bench.workload import Workload
from afd.model.weights import load_model_config
from afd.planning import costs, ratio
from afd.planning.deployment import Deployment, memory_of
from afd.planning.plan import Slo, decode_score, decode_step_s, format_plan, plan
from afd.planning.profile import Part, Profile, load_profile

V3 = costs.shapes_of(load_model_config("deepseek-v3"), "fp8")
BASE = Deployment("none", max_num_seqs=1024, max_num_batched_tokens=8192)
LAYOUTS = [
    replace(BASE, connector="ep", attention=16, ffn=16, ubatches=2),
    replace(BASE, connector="async", attention=10, ffn=6, ubatches=3, ubatch_decode=True),
    replace(BASE, connector="async", attention=8, ffn=8),
    replace(BASE, connector="p2p", attention=10, ffn=6),
]


@pytest.mark.parametrize("d", LAYOUTS, ids=lambda d: d.name)
def test_the_batch_is_the_largest_that_meets_the_tpot_bound(d):
    """The batch's step meets the bound and one more sequence would not (or the cache holds no more); the output
    per GPU is the unit's replicas times the batch over the step, over the unit's GPUs."""
    p, slo, ctx = load_profile("h200-deepseek-v3"), Slo(tpot_p50_s=0.05), 4160
    row = decode_score(d, V3, p, ctx, slo)
    b = row["batch"]
    assert 0 < b <= row["batch_held"] and row["tpot_p50_s"] <= slo.tpot_p50_s
    assert b == row["batch_held"] or decode_step_s(d, V3, p, b + 1, ctx) > slo.tpot_p50_s
    assert row["tokens_per_s_per_gpu"] == pytest.approx(d.attention * b / row["tpot_p50_s"] / d.group_ranks)
    assert row["ttft_p90_s"] is None and row["meets_slo"]


def test_with_a_loose_bound_the_cache_or_max_num_seqs_sets_the_batch():
    p, d = load_profile("h200-deepseek-v3"), LAYOUTS[2]
    kv = memory_of(d, V3, p.gpu_memory_bytes).kv_tokens_per_replica
    held = {ctx: decode_score(d, V3, p, ctx, Slo(tpot_p50_s=100.0))["batch"] for ctx in (1024, 4096, 16384)}
    # 16-token blocks (these contexts fill them exactly), at most max_num_seqs
    assert held == {ctx: min(kv // ctx, d.max_num_seqs) for ctx in held} and held[1024] == d.max_num_seqs
    assert held[1024] > held[4096] > held[16384] > 0


def test_a_bound_no_step_meets_scores_zero():
    row = decode_score(LAYOUTS[2], V3, load_profile("h200-deepseek-v3"), 4160, Slo(tpot_p50_s=1e-4))
    assert row["batch"] == 0 and row["tokens_per_s_per_gpu"] == 0.0 and not row["meets_slo"]


def test_the_steady_state_agrees_with_the_closed_form_output_per_gpu():
    """Two code paths over the same parts: the steady state's step (`StepCosts`) and the ratio rule's
    Φ(r) = r·batch / ((r + 1)·cycle) (`ratio.per_gpu`), for async rA1F on a linear profile with no host costs."""
    s = costs.shapes_of(load_model_config("deepseek-v2-lite"), "bfloat16")
    per_row_flops = 2.0 * s.expert_params * s.topk
    parts = {
        "attention_decode": Part(fixed_s=50e-6 * s.moe_layers, peak_flops=2.0 * s.attention_side_params / 1e-6),
        "routed_experts": Part(fixed_s=80e-6, peak_flops=per_row_flops / 0.3e-6),
        "exchange_async": Part(fixed_s=5e-6, bandwidth_Bps=costs.exchange_bytes(s, "async", 1, 1) / 0.02e-6),
    }
    p = Profile({"device": "synthetic"}, parts, gpu_memory_bytes=1e12)
    for r in (1, 3, 7):
        d = Deployment("async", r, 1, max_num_seqs=64)
        row = decode_score(d, s, p, 512, Slo(tpot_p50_s=0.05))
        phi = ratio.per_gpu(p, s, "async", 1, row["batch"], 512, float(r))
        assert row["tokens_per_s_per_gpu"] == pytest.approx(phi, rel=1e-6), r


def test_plan_decode_only_ranks_by_the_steady_state_and_says_so(tmp_path, capsys):
    p = load_profile("h200-deepseek-v3")
    w = Workload("uniform", 8, long_len=4096, short_len=4096, max_tokens=128)
    result = plan(16, V3, p, w, Slo(tpot_p50_s=0.05), BASE, decode_only=True)
    assert result["decode_only"] == {"context": 4160}
    rows = result["candidates"]
    assert rows == sorted(rows, key=lambda r: -r["tokens_per_s_per_gpu"])
    assert all(r["ttft_p90_s"] is None and r["batch"] <= r["batch_held"] for r in rows)
    assert {r["connector"] for r in rows} >= {"ep", "p2p", "async"}
    # decode steps are split only with ubatch_decode: without it, async's micro-batch counts would score alike
    assert {r["ubatches"] for r in rows if r["connector"] == "async"} == {1}
    split = plan(16, V3, p, w, Slo(tpot_p50_s=0.05), replace(BASE, ubatch_decode=True), decode_only=True)
    assert {r["ubatches"] for r in split["candidates"] if r["connector"] == "async"} == {1, 2, 3}
    assert "decode only: every sequence at 4,160 tokens of context" in format_plan(result)
    out = tmp_path / "plan.json"
    code, err = main_exit(capsys, "plan", "--model", "deepseek-v3", "--gpus", "16", "--decode-only", "--workload",
                          "uniform", "--short-len", "4096", "--long-len", "4096", "--max-tokens", "128",
                          "--requests", "8", "--json", str(out))  # fmt: skip
    assert code == 0, err
    written = json.loads(out.read_text())
    assert written["best"]["tokens_per_s_per_gpu"] == pytest.approx(result["best"]["tokens_per_s_per_gpu"])


def test_one_gpu_has_no_afd_layout_and_so_no_ratio():
    s = costs.shapes_of(load_model_config("deepseek-v2-lite"), "bfloat16")
    w = Workload("uniform", 8, long_len=1024, short_len=1024, max_tokens=64)
    result = plan(1, s, load_profile("h200"), w, Slo(), BASE, decode_only=True)
    assert {r["connector"] for r in result["candidates"]} == {"none"} and result["afd_over_non_afd"] is None
    assert format_plan(result).splitlines()[-1] == "best AFD / best non-AFD: -"
