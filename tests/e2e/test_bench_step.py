"""`afd bench step` on the tiny model (CPU): it runs as a user runs it, prints the table and writes the
fields; the floor's arithmetic on DeepSeek-V2-Lite shapes matches the issue's estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_afd(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_bench_step_prints_and_writes_every_point(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    proc = run_afd(
        "bench", "step", "--batch", "1,3", "--context", "5,20", "--prefill", "2x8", "--steps", "2", "--json", str(out),
        timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["copy_bandwidth_GBps"] > 0 and result["matmul_TFLOPs"] > 0
    points = {(r["batch"], r["context"]): r for r in result["decode"]}
    assert set(points) == {(1, 5), (3, 5), (1, 20), (3, 20)}
    for r in points.values():
        assert (
            r["eager_ms"] > 0
            and r["floor_ms"] > 0
            and r["eager_over_floor"] == pytest.approx(r["eager_ms"] / r["floor_ms"])
        )
        assert r["graph_ms"] is None  # CPU never captures
    assert points[(3, 20)]["floor_bytes"] > points[(1, 20)]["floor_bytes"] > points[(1, 5)]["floor_bytes"]
    (prefill,) = result["prefill"]
    assert prefill["tokens"] == 16 and prefill["ms"] > 0 and prefill["floor_ms"] > 0
    assert "eager ms" in proc.stdout and "floor ms" in proc.stdout and "prefill" in proc.stdout


@pytest.mark.timeout(60)
def test_bench_step_rejects_bad_lists_in_one_sentence() -> None:
    proc = run_afd("bench", "step", "--batch", "1,x", timeout=50)
    assert proc.returncode == 2 and "--batch takes positive integers" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_afd("bench", "step", "--prefill", "8by1024", timeout=50)
    assert proc.returncode == 2 and "--prefill takes BxC pairs" in proc.stderr


@pytest.mark.timeout(120)
def test_bench_step_ragged_row_beside_its_uniform_batch(tmp_path: Path) -> None:
    """`--contexts 4,12`: a batch of 4 alternating between 4 and 12 cached tokens, timed beside a uniform batch
    at their mean (8: the same 32 tokens in all); a batch of 1 cannot alternate and gets no ragged row."""
    out = tmp_path / "step.json"
    proc = run_afd(
        "bench", "step", "--batch", "1,4", "--context", "5", "--contexts", "4,12", "--prefill", "1x4", "--steps", "2",
        "--json", str(out), timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert {(r["batch"], r["context"]) for r in result["decode"]} == {(1, 5), (4, 5)}
    (row,) = result["ragged"]
    assert row["batch"] == 4 and row["contexts"] == [4, 12] and row["context"] == 8
    assert row["total_context"] == row["uniform_total_context"] == 32
    assert row["eager_ms"] > 0 and row["uniform_eager_ms"] > 0 and row["floor_ms"] > 0
    assert row["eager_over_uniform"] == pytest.approx(row["eager_ms"] / row["uniform_eager_ms"])
    assert row["graph_ms"] is None and row["graph_over_uniform"] is None  # CPU never captures
    assert "ragged" in proc.stdout and "4,12" in proc.stdout and "eager" in proc.stdout


@pytest.mark.timeout(60)
def test_bench_step_rejects_contexts_it_cannot_alternate() -> None:
    proc = run_afd("bench", "step", "--contexts", "512", timeout=50)
    assert proc.returncode == 2 and "at least two different contexts" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_afd("bench", "step", "--batch", "2", "--contexts", "4,8,16", timeout=50)
    assert proc.returncode == 2 and "a --batch of at least 3" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_afd("bench", "step", "--contexts", "4,x", timeout=50)
    assert proc.returncode == 2 and "--contexts takes positive integers" in proc.stderr


@pytest.mark.timeout(120)
def test_bench_step_quantized_prints_its_16_bit_peer_beside_it(tmp_path: Path) -> None:
    """`--quantization fp8` runs the same weights unquantized too: the FP8 table, then both side by side (ratio per
    point), and the JSON keeps the 16-bit run under "baseline"."""
    out = tmp_path / "step.json"
    proc = run_afd(
        "bench", "step", "--batch", "2", "--context", "8", "--prefill", "1x16", "--steps", "2", "--quantization", "fp8",
        "--json", str(out), timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "float32 (base) vs float32+fp8" in proc.stdout
    side_by_side = proc.stdout.split("float32 (base) vs float32+fp8")[1].splitlines()
    decode = next(line.split() for line in side_by_side if line.split()[:2] == ["2", "8"])
    result = json.loads(out.read_text())
    base_ms, fp8_ms = result["baseline"]["decode"][0]["eager_ms"], result["decode"][0]["eager_ms"]  # no graphs on CPU
    assert decode[2:5] == [f"{base_ms:.2f}", f"{fp8_ms:.2f}", f"{fp8_ms / base_ms:.2f}x"]
    assert result["fp8_weights"] and not result["baseline"]["fp8_weights"]
    assert [(r["batch"], r["context"]) for r in result["baseline"]["decode"]] == [(2, 8)]
    assert result["decode"][0]["floor_ms"] < result["baseline"]["decode"][0]["floor_ms"]  # fp8 bytes count less


@pytest.mark.timeout(120)
def test_a_presets_first_layers_run_bench_step_and_the_cost_model_prices_them(tmp_path: Path) -> None:
    """`scripts/model_slice.py`: `afd bench step` over the tiny preset's first two layers (one dense), FP8 beside the
    same weights unquantized; `scripts/predict_step.py` sets the cost model's step beside each measured row the
    slice has (prefill here: a CPU has no graph ms for decode rows), for both weight formats."""
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    out = tmp_path / "slice.json"
    slice_args = ["--model", "tiny", "--layers", "2", "--dense-layers", "1"]
    proc = subprocess.run(
        [sys.executable, str(scripts / "model_slice.py"), *slice_args, "--", "bench", "step", "--batch", "1",
         "--context", "5", "--prefill", "2x8", "--steps", "2", "--quantization", "fp8", "--json", str(out)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-first-2-layers" and result["fp8_weights"] and not result["baseline"]["fp8_weights"]
    assert "float32+fp8" in proc.stdout
    proc = subprocess.run(
        [sys.executable, str(scripts / "predict_step.py"), str(out), *slice_args, "--profile", "h200-published"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("tiny-first-2-layers: step ms measured / predicted")
    prefill = [line.split() for line in lines[1:] if "prefill" in line]
    assert [(row[0], row[-1]) for row in prefill] == [("float32", "h200-published"), ("fp8", "h200-published")]
    measured = [float(row[-5]) for row in prefill]
    assert measured == [pytest.approx(result["baseline"]["prefill"][0]["ms"], abs=0.01),
                        pytest.approx(result["prefill"][0]["ms"], abs=0.01)]  # fmt: skip
