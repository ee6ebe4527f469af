"""`afd bench step --mixed DxC` (afd.bench.step.mixed_row, afd.bench.mixed_step) on the tiny model (CPU): the mixed
step really holds D decodes beside one C-token chunk, its halves are timed alone, the row and its table line carry the
sum and the ratio, and a bad value is refused in one sentence."""

from __future__ import annotations

import pytest
import torch
from helpers.cli import main_exit

from afd.bench.step import format_bench_step, mixed_row, run_bench_step
from afd.engine.engine import Engine, LocalExchange
from afd.model.weights import load_attention_model, load_ffn_model


@pytest.mark.timeout(120)
def test_mixed_row_times_a_mixed_step_beside_its_halves() -> None:
    """Every launched step of the row, in order: the warm-up and timed decode steps (3 decodes), the mixed steps
    (3 decodes, then one 8-token chunk), the prefill steps alone (one 8-token chunk)."""
    engine = Engine(load_attention_model("tiny"), LocalExchange(load_ffn_model("tiny")), 11, max_num_seqs=4)
    launched: list[list[int]] = []
    launch = engine.runner.launch

    def record(scheduled, *args, **kwargs):
        launched.append([len(s.input_ids) for s in scheduled])
        return launch(scheduled, *args, **kwargs)

    engine.runner.launch = record
    row = mixed_row(engine, 3, 5, 8, 2, torch.Generator().manual_seed(0), 10)
    assert launched == [[1, 1, 1]] * 3 + [[1, 1, 1, 8]] * 3 + [[8]] * 3
    assert row["decodes"] == 3 and row["context"] == 5 and row["chunk"] == 8 and row["tokens"] == 11
    assert row["mixed_ms"] > 0 and row["decode_ms"] > 0 and row["prefill_ms"] > 0
    assert row["sum_ms"] == pytest.approx(row["decode_ms"] + row["prefill_ms"])
    assert row["mixed_over_sum"] == pytest.approx(row["mixed_ms"] / row["sum_ms"])
    assert 0 < row["mixed_host_ms"] <= row["mixed_ms"]  # on CPU the host does the step's work too
    assert row["host_over_mixed"] == pytest.approx(row["mixed_host_ms"] / row["mixed_ms"])
    assert not engine.running and not engine.waiting
    assert engine.overlap_steps == Engine(engine.model, engine.exchange, 11, max_num_seqs=4).overlap_steps


@pytest.mark.timeout(120)
def test_bench_step_has_a_mixed_row_per_context() -> None:
    result = run_bench_step(
        model="tiny", dtype="float32", device="cpu", batches=[1], contexts=[5, 9], prefills=[], mixed=[(3, 8)], steps=2
    )
    rows = result["mixed"]
    assert [(r["decodes"], r["context"], r["chunk"]) for r in rows] == [(3, 5, 8), (3, 9, 8)]
    table = format_bench_step(result)
    assert "mixed/sum" in table and f"{rows[0]['mixed_over_sum']:.2f}x" in table
    assert "host/mixed" in table and f"{rows[0]['host_over_mixed']:.0%}" in table


def test_bench_step_refuses_a_bad_mixed_value_in_one_sentence(capsys: pytest.CaptureFixture) -> None:
    for value in ("256by1792", "256x0", "x1792", "256x1792,"):
        code, err = main_exit(capsys, "bench", "step", "--mixed", value)
        assert code == 2 and "--mixed takes DxC pairs" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(120)
def test_bench_step_rows_run_with_overlapped_steps_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the engine overlaps every step: the prefill and mixed rows must still finalize each timed step (a
    prefill row once failed there with "did not finish in one step"); forced on here, on CPU."""
    import afd.bench.step as step

    class Overlapped(Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs, overlap_steps=True)

    monkeypatch.setattr(step, "Engine", Overlapped)
    result = run_bench_step(
        model="tiny",
        dtype="float32",
        device="cpu",
        batches=[2],
        contexts=[5],
        prefills=[(2, 8)],
        mixed=[(2, 8)],
        steps=2,
    )
    assert result["overlap_steps"] is True
    assert [(r["batch"], r["tokens"]) for r in result["prefill"]] == [(2, 16)]
    assert result["prefill"][0]["ms"] > 0 and result["mixed"][0]["mixed_ms"] > 0
    assert result["decode"][0]["eager_launched_ahead"] == 1  # two calls on CPU, the first not launched ahead
