"""The README's main job (`afd demo`) and `afd bench`, run as a user runs them."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_afd(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(240)
def test_demo_runs_every_connector_and_passes() -> None:
    proc = run_afd("demo", timeout=220)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()[:1]}
    assert {"none", "p2p", "async"} <= set(rows)
    assert rows["p2p"][1] == rows["async"][1] == "2A2F"
    for connector in ("p2p", "async"):
        assert float(rows[connector][-1]) <= 1e-4  # max |Δ logprob| against the reference
    assert "every connector matches the reference" in proc.stdout
    assert "running p2p 2A2F" in proc.stderr and "running async 2A2F" in proc.stderr  # progress while it runs


@pytest.mark.timeout(240)
def test_bench_writes_raw_json_with_side_by_side_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_afd(
        "bench",
        "--attention",
        "2",
        "--ffn",
        "1",
        "--requests",
        "2",
        "--long-len",
        "24",
        "--short-len",
        "3",
        "--max-new-tokens",
        "3",
        "--ubatches",
        "1,2",
        "--json",
        str(out),
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["topology"] == "2A1F" and result["model"] == "tiny"
    runs = {(r["connector"], r["ubatches"]): r for r in result["runs"]}
    assert set(runs) == {("p2p", 1), ("p2p", 2), ("async", 1), ("async", 2)}  # each connector per count
    # each connector where it runs the shared experts by default: async on its attention rank (+sa)
    assert {r["shared_experts"] for r in result["runs"] if r["connector"] == "async"} == {"attention"}
    assert set(result["numerics"]) == {"p2p", "p2p m=2", "async+sa", "async+sa m=2"}
    assert "async+sa m=2" in proc.stdout and "p2p m=2" in proc.stdout
    for run in runs.values():
        assert run["generated_tokens"] == 2 * 2 * 3 and run["tokens_per_s"] > 0
        assert len(run["replicas"]) == 2
        # 3 new tokens: the prefill step gives the first, then 2 all-decode steps per replica are timed
        assert [r["decode_steps"] for r in run["replicas"]] == [2, 2] and run["decode_step_p50_ms"] > 0
    assert "decode step p50" in proc.stdout
    # every replica scores prompt + the reference's continuation: (24 + 3 - 1) or (3 + 3 - 1) positions each
    for numerics in result["numerics"].values():
        assert numerics["positions"] == 2 * (24 + 3 - 1) + 2 * (3 + 3 - 1)
        assert numerics["max_abs_dprob"] < 1e-4  # float32


@pytest.mark.timeout(120)
def test_bench_takes_a_token_budget_and_prefills_in_chunks_within_it(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--attention", "1", "--ffn", "1", "--connectors", "p2p,async", "--requests", "2", "--long-len", "24"]
    args += ["--short-len", "24", "--max-new-tokens", "2", "--max-num-batched-tokens", "16", "--json", str(out)]
    proc = run_afd("bench", *args, "--shared-experts", "ffn,attention", timeout=110)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["max_num_batched_tokens"] == 16  # 24-token prompts: prefilled over several steps
    # the shared experts on the attention rank: async only (p2p has no such run)
    assert {(r["connector"], r["shared_experts"]) for r in result["runs"]} == {
        ("p2p", "ffn"),
        ("async", "ffn"),
        ("async", "attention"),
    }
    assert set(result["numerics"]) == {"p2p", "async", "async+sa"}
    assert "async+sa: elapsed" in proc.stdout and "with the shared experts on the FFN ranks" in proc.stdout
    for numerics in result["numerics"].values():  # chunked prefill through every run equals the reference
        assert numerics["positions"] == 2 * (24 + 2 - 1) and numerics["max_abs_dprob"] < 1e-4


@pytest.mark.timeout(30)
def test_bench_rejects_unknown_connector() -> None:
    proc = run_afd("bench", "--connectors", "p2p,nccl", timeout=25)
    assert proc.returncode == 2 and "--connectors takes p2p and/or async" in proc.stderr


@pytest.mark.timeout(30)
def test_bench_rejects_an_unknown_place_for_the_shared_experts() -> None:
    proc = run_afd("bench", "--shared-experts", "ffn,gpu", timeout=25)
    assert proc.returncode == 2 and "--shared-experts takes ffn and/or attention" in proc.stderr


@pytest.mark.timeout(30)
def test_bench_refuses_a_micro_batch_count_the_async_config_refuses() -> None:
    proc = run_afd("bench", "--ubatches", "1,40", timeout=25)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--ubatches 40" in proc.stderr


@pytest.mark.gpu
def test_reference_run_hands_the_gpu_back_before_ranks_launch() -> None:
    """The in-process reference's KV pool takes 0.9 of the GPU; left cached, it made every launched rank of
    `afd bench` run out of memory (nvidia-h200-x2, 2026-11-30)."""
    import torch

    from afd.bench.harness import run_reference
    from afd.runtime.spec import RunSpec

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = RunSpec(model="tiny", dtype="bfloat16", device="cuda", max_new_tokens=2)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()  # what earlier tests in this process still hold is not the reference's
    run_reference(spec, [[1, 2, 3]])
    # its pool alone is 0.63 GiB; ~96 MiB stayed allocated on an H200 (module-level caches), not the pool
    assert torch.cuda.memory_reserved() - before < 256 << 20, torch.cuda.memory_summary()


@pytest.mark.timeout(240)
def test_bench_repeat_launches_every_configuration_in_rounds_and_keeps_the_median(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--attention", "1", "--ffn", "1", "--connectors", "async", "--requests", "2", "--long-len", "12"]
    args += ["--short-len", "12", "--max-new-tokens", "2", "--ubatches", "1,2", "--repeat", "2", "--no-score"]
    proc = run_afd("bench", *args, "--json", str(out), timeout=220)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["repeat"] == 2 and len(result["runs"]) == 2
    for run in result["runs"]:
        launches = run["launches_elapsed_s"]
        assert len(launches) == 2 and run["elapsed_s"] == min(launches)  # the lower middle of two
    assert proc.stderr.count("(launch 2 of 2)") == 2  # the second round launches both configurations again
    assert "each row: the median of 2 launches" in proc.stdout
    assert "async+sa m=2: elapsed" in proc.stdout and "without micro-batches" in proc.stdout  # the default placement
