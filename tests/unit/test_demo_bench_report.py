"""`afd demo` and `afd bench` without launching ranks: the warm reference and what its numbers mean, prompts that must
fit the model, the median over rounds and the table."""

from __future__ import annotations

import pytest


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
