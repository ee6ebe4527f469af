"""The README's main job (`afd demo`) and `afd bench`, run as a user runs them."""

from __future__ import annotations

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


def test_demo_times_a_warm_reference_and_says_what_the_numbers_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference row was one cold run whose tok/s swung 14-311 across five runs."""
    import afd.bench.demo as demo
    from afd.bench.harness import RunResult

    runs = []

    def fake_reference(spec, prompts):
        runs.append(len(prompts))
        return RunResult("none", "1 proc", [], elapsed_s=float(len(runs)), ttft_s=[0.01])

    monkeypatch.setattr(demo, "run_reference", fake_reference)
    reference, connector_runs, ok = demo.run_demo(connectors=(), progress=lambda msg: None)
    assert runs == [8, 8] and reference.elapsed_s == 2.0  # an untimed warm-up, then the timed run
    assert connector_runs == [] and ok
    table = " ".join(demo.format_table(reference, []).split())
    assert "after an untimed warm-up run" in table and "tok/s: generated tokens / engine time" in table


def test_bench_prompts_must_fit_the_models_positions(capsys: pytest.CaptureFixture) -> None:
    from afd.cli.main import main

    assert main(["bench", "--long-len", "4064", "--max-new-tokens", "32"]) == 2  # + 1 scored token: 4097 > 4096
    err = capsys.readouterr().err
    assert "prompt 0 has 4064 tokens and --max-new-tokens is 33: 4097 positions" in err


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
    run_reference(spec, [[1, 2, 3]])
    # its pool alone is 0.63 GiB; ~96 MiB stayed allocated on an H200 (module-level caches), not the pool
    assert torch.cuda.memory_reserved() < 256 << 20, torch.cuda.memory_summary()


def test_median_launch_and_the_micro_batching_gain_line() -> None:
    from afd.bench.offline import median_launch, ubatch_gains

    launches = [{"elapsed_s": t, "id": i} for i, t in enumerate([0.30, 0.10, 0.20, 0.40])]
    assert median_launch(launches)["id"] == 2  # 0.20: the lower middle of four, a real launch
    assert median_launch(launches[:3])["id"] == 2
    runs = [
        {"connector": "async", "ubatches": 1, "elapsed_s": 0.20},
        {"connector": "async", "ubatches": 2, "elapsed_s": 0.15},
        {"connector": "p2p", "ubatches": 2, "elapsed_s": 0.30},  # no p2p run without micro-batches: no line
    ]
    assert ubatch_gains(runs) == ["async m=2: elapsed 0.150 s vs 0.200 s without micro-batches (+25.0% faster)"]
    runs = [
        {"connector": "async", "ubatches": 1, "elapsed_s": 0.20},
        {"connector": "async", "ubatches": 1, "shared_experts": "attention", "elapsed_s": 0.16},
    ]
    assert ubatch_gains(runs) == [
        "async+sa: elapsed 0.160 s vs 0.200 s with the shared experts on the FFN ranks (+20.0% faster)"
    ]


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


def test_bench_table_fits_its_longest_label_and_says_when_no_decode_step_was_timed() -> None:
    from afd.bench.offline import format_bench

    run = {
        "tokens_per_s": 80.0,
        "ttft_p50_s": 0.1,
        "ttft_p99_s": 0.1,
        "elapsed_s": 0.1,
        "replicas": [{"elapsed_s": 0.1}],
    }
    result = {
        "model": "tiny",
        "dtype": "float32",
        "device": "cpu",
        "topology": "1A1F",
        "workload": {},
        "runs": [
            {**run, "connector": "async", "ubatches": 2, "shared_experts": "attention", "decode_step_p50_ms": None},
            {**run, "connector": "p2p", "ubatches": 1, "decode_step_p50_ms": 12.5},
        ],
    }
    header, long_row, short_row = format_bench(result).splitlines()[2:5]
    assert long_row.startswith("async+sa m=2 ") and short_row.startswith("p2p ")
    end = header.index("tok/s") + len("tok/s")  # right-aligned: every row's number ends where the header does
    assert long_row.index("80.0") + len("80.0") == end == short_row.index("80.0") + len("80.0")
    assert long_row.split()[-2] == "-" and "nan" not in long_row and "12.50ms" in short_row
