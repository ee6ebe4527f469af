"""`afd bench serve --overhead` run as a user runs it on the tiny model, and the run harness's place below the commands
and above the role runtimes (each runtime imported alone, in a fresh interpreter)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import e2e
from helpers.e2e import Leftovers

from afd.bench.serve_client import (
    TTFT_STAGES,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _kill_tagged_servers() -> None:
    """`afd serve` front ends of this test still alive (a bench killed by the timeout leaves its server)."""
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        cmdline = e2e._cmdline(pid) if pid else []
        if cmdline[1:4] == [b"-m", b"afd", b"serve"] and e2e._tagged(pid, e2e.test_tag()):
            try:
                os.killpg(pid, signal.SIGKILL)  # a ServerProcess is its own session
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.timeout(150)
def test_bench_serve_overhead_smoke_on_tiny(tmp_path: Path) -> None:
    """HTTP vs the engine alone in one run, from a trace, with the raw JSON (and the plot where matplotlib is):
    no timing assertions, only that every number is there and nothing is left behind."""
    trace = write(tmp_path / "trace.jsonl", "".join(f'{{"prompt_len": {n}, "max_tokens": 3}}\n' for n in (9, 30, 4)))
    out, png = tmp_path / "out.json", tmp_path / "plot.png"
    plot = ["--plot", str(png)] if _has("matplotlib") else []
    small = ["--max-num-seqs", "8", "--max-model-len", "256", "--max-num-batched-tokens", "256"]
    argv = ["bench", "serve", "--overhead", "--trace", str(trace), "--rates", "4", *small, "--json", str(out), *plot]
    leftovers = Leftovers()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "afd", *argv], capture_output=True, text=True, timeout=130, env=_env()
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "engine alone: rate 4/s: 3/3 requests" in proc.stderr  # progress lines (stderr is no terminal)
        assert "front end over the engine alone" in proc.stdout and "the front end adds" in proc.stdout
        raw = json.loads(out.read_text())
        assert [r["name"] for r in raw["results"]] == ["none R=1", "engine alone"]
        assert raw["workload"]["kind"] == "trace" and raw["workload"]["trace_file"] == str(trace)
        assert raw["workload"]["warmups"] == 8  # the default: here all three requests, once untimed
        for res in raw["results"]:
            s = res["runs"][0]["summary"]
            assert (s["completed"], s["errors"], s["output_tokens"]) == (3, 0, 9) and s["tpot_p50_s"] is not None
            assert res["slo"]["slo_ttft_s"] == 5.0
        (row,) = raw["front_end_overhead"]
        assert row["rate"] == 4.0 and row["requests"] == 3 and None not in row.values()
        # the server reported each request's engine share, and it is a part of what the client measured
        served = raw["results"][0]["runs"][0]["requests"]
        assert all(0 < r["engine_ttft_s"] < r["ttft_s"] for r in served), served
        assert 0 < row["front_end_p50_s"] <= row["front_end_p90_s"] and row["http_floor_p50_s"] > 0
        # on one host the client's TTFT is cut at the server's stamps: every stage took time, and they sum to it
        for r in served:
            assert all(s > 0 for s in r["stages_s"].values()), r["stages_s"]
            assert math.isclose(sum(r["stages_s"].values()), r["ttft_s"], rel_tol=1e-6)
            assert math.isclose(r["stages_s"]["engine"], r["engine_ttft_s"], rel_tol=1e-6, abs_tol=1e-6)
        assert set(row["ttft_stages_p50_s"]) == {name for name, _ in TTFT_STAGES}
        assert "the server's TTFT by stage" in proc.stdout
        assert not plot or png.read_bytes()[:4] == b"\x89PNG"
        leftovers.check()
    finally:
        _kill_tagged_servers()
        leftovers.cleanup()


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


# ---------------------------------------------------------------- structure
RUNTIMES = (
    "afd.runtime.rank",
    "afd.runtime.online",
    "afd.runtime.worker",
    "afd.runtime.async_rank",
    "afd.bench.harness",
)


def test_the_runtimes_import_alone() -> None:
    """Each rank runtime imports first in a fresh interpreter's module table (the layer order itself is
    tests/unit/test_layers.py's); torch is loaded once to keep it fast."""
    script = (
        "import importlib, sys, torch\n"
        f"for name in {list(RUNTIMES)}:\n"
        "    for m in [m for m in sys.modules if m == 'afd' or m.startswith('afd.')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.timeout(60)
def test_a_server_that_fails_to_start_says_why():
    """A server that exits at start-up is reported by its status and the last line it wrote, not as a timeout."""
    from afd.serve.run import ServeError, ServerProcess

    with pytest.raises(ServeError) as failed:
        ServerProcess(["--model", "no-such-model"], timeout_s=50)
    assert "exited with status 2" in str(failed.value)
    assert "it said: afd: error:" in str(failed.value) and "no-such-model" in str(failed.value)
