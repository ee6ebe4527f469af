"""`afd profile` end to end on tiny (CPU): the parts measured and fitted, then a short calibration trace served by
`afd serve` and fitted into the profile; `afd simulate` reads it back; `afd profile --refit` fits its kept rows
again to the same profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")


def _afd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=timeout)


def test_profile_with_a_short_calibration_then_simulate(tmp_path):
    out = tmp_path / "cpu.json"
    res = _afd("profile", "--model", "tiny", "--no-exchange", "--calibration-requests", "12",
               "--calibration-rates", "inf", "-o", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "attention_decode fit" in res.stderr and "calibration:" in res.stderr
    data = json.loads(out.read_text())
    cal = data["calibration"]
    assert cal["fit"]["rows"] and cal["fit"]["server"].startswith("afd serve")
    assert cal["step_s"] + cal["token_s"] + cal["request_s"] > 0  # serving costs more than the kernels
    sim = _afd("simulate", "--model", "tiny", "--profile", str(out), "--requests", "50", "--short-len", "32",
               "--long-len", "256", "--max-tokens", "16")  # fmt: skip
    assert sim.returncode == 0, sim.stderr[-2000:]
    # the rows it was fitted to travel with it: fitted again, by the same code, they give the same profile
    assert data["measured"]["parts"]["decode"] and data["measured"]["calibration"]["runs"]
    again = tmp_path / "again.json"
    res = _afd("profile", "--refit", str(out), "-o", str(again))
    assert res.returncode == 0, res.stderr[-2000:]
    refit = json.loads(again.read_text())
    assert refit["parts"] == data["parts"] and refit["calibration"] == data["calibration"]


def test_profile_refuses_a_bad_calibration_flag(tmp_path):
    res = _afd("profile", "--model", "tiny", "--calibration-requests", "0", "-o", str(tmp_path / "x.json"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("afd profile: error:") or "error" in res.stderr


def test_colocated_parts_measured_in_whole_steps_and_simulated(tmp_path):
    """`afd profile --colocated`: async 1A1F runs with both ranks on this machine (real processes), their steps
    less the profile's parts kept per layer; `afd simulate --colocated` then prices co-located steps with them.
    With another job's flag: one sentence, exit 2."""
    base = Path(__file__).resolve().parents[2] / "docs" / "bench" / "2026-12-01_cpu_profile_tiny.json"
    out = tmp_path / "colocated.json"
    res = _afd("profile", "--model", "tiny", "--colocated", "--profile", str(base), "-o", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    data, before = json.loads(out.read_text()), json.loads(base.read_text())
    runs = data["measured"]["colocated"]
    assert runs["decode"]["batch"] == 64 and len(runs["decode"]["steps_ms"]) >= 60  # 63 all-decode steps
    assert runs["prompt"]["num_steps"] == 16 and runs["prompt"]["step_s"] > 0
    assert {"colocated_decode", "colocated_prompt"} <= set(data["parts"])
    assert all(data["parts"][k]["fixed_s"] >= 0 for k in ("colocated_decode", "colocated_prompt"))
    assert {k: v for k, v in data["parts"].items() if not k.startswith("colocated")} == before["parts"]
    flags = ["--model", "tiny", "--connector", "async", "--requests", "40", "--short-len", "32", "--long-len", "64",
             "--max-tokens", "8", "--json"]  # fmt: skip
    sims = {}
    for name, profile in (("measured", out), ("base", base)):
        sim = _afd("simulate", "--profile", str(profile), *flags, str(tmp_path / f"{name}.json"), "--colocated")
        assert sim.returncode == 0, sim.stderr[-2000:]
        sims[name] = json.loads((tmp_path / f"{name}.json").read_text())["results"][0]["runs"][0]["summary"]
    assert sims["measured"]["tpot_p50_s"] != sims["base"]["tpot_p50_s"]  # (ranks apart: the unit tests)
    res = _afd("profile", "--colocated", "--refit", str(base), "-o", str(tmp_path / "x.json"))
    assert res.returncode == 2 and "different jobs" in res.stderr.strip().splitlines()[-1]
