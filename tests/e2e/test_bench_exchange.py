"""`afd bench exchange` on the tiny model (CPU): both connectors run their 1A1F round trips through real
processes, the table is printed and the JSON holds every point (no timing assertions: CI cores are busy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from afd.bench.exchange import row_bytes


@pytest.mark.timeout(120)
def test_bench_exchange_prints_and_writes_every_point(tmp_path: Path) -> None:
    out = tmp_path / "exchange.json"
    args = ["bench", "exchange", "--tokens", "1,8,64", "--iters", "3", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["topology"] == "1A1F" and result["ranks_on"] == {"attention": "cpu", "ffn": "cpu"}
    points = {(r["connector"], r["tokens"]): r for r in result["rows"]}
    assert set(points) == {(c, t) for c in ("p2p", "async") for t in (1, 8, 64)}
    there, back = row_bytes(64, 3, 4)  # tiny: hidden 64, top-3, float32
    for (_, tokens), r in points.items():
        assert r["bytes"] == tokens * (there + back)
        assert 0 < r["p50_us"] <= r["p90_us"] and r["mean_us"] > 0 and r["copy_us"] > 0
        assert r["p50_over_copy"] == pytest.approx(r["p50_us"] / r["copy_us"])
    assert "p50/copy" in proc.stdout and "async" in proc.stdout and "p2p" in proc.stdout


@pytest.mark.timeout(120)
def test_bench_exchange_times_passes_of_layers(tmp_path: Path) -> None:
    """--layers 4: passes of 4 exchanges in layer order, per-layer times."""
    out = tmp_path / "exchange.json"
    args = ["bench", "exchange", "--tokens", "1,8", "--iters", "3", "--layers", "4", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["layers"] == 4 and not result["graph"]
    assert {(r["connector"], r["tokens"]) for r in result["rows"]} == {(c, t) for c in ("p2p", "async") for t in (1, 8)}
    assert all(0 < r["p50_us"] <= r["p90_us"] for r in result["rows"])
    assert "passes of 4 layers (times per layer)" in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, sentence",
    [(["--tokens", "1,0"], "--tokens takes positive integers"), (["--graph"], "--graph captures CUDA graphs")],
)
def test_bench_exchange_rejects_bad_input_in_one_sentence(flags: list[str], sentence: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "afd", "bench", "exchange", *flags], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 2 and sentence in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_exchange_stress_checks_every_reply_against_its_request(tmp_path: Path) -> None:
    """The ordering stress test through real processes and shared memory: random sizes, an echo FFN, every
    reply compared with its request (the GPU run uses >= 50,000 round trips over NVSHMEM)."""
    out = tmp_path / "stress.json"
    args = ["bench", "exchange", "--stress", "400", "--tokens", "32", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["round_trips"] == 400 and result["messages"] == 800 and result["mismatches"] == 0
    assert "0 mismatches" in proc.stdout
