"""`afd profile` end to end on tiny (CPU): the parts measured and fitted, then a short calibration trace served by
`afd serve` and fitted into the profile; `afd simulate` reads it back; `afd profile --refit` fits its kept rows
again to the same profile."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")


def _afd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m afd ARGS`; past `timeout` it is interrupted (SIGINT: `afd profile` then stops the `afd serve` it
    started, which lives in a session of its own), killed if still there, and the test fails with its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "afd", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        pytest.fail(f"afd {args[0]} ran past {timeout:g} s; its stderr ended: {stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# About 10 s on an idle 2-core host; 90 s there with another process's torch threads on both cores, as CI's second
# worker may run. The child's own bound comes first, so a slow run fails with its stderr rather than pytest's stack.
@pytest.mark.timeout(600)
def test_profile_with_a_short_calibration_then_simulate(tmp_path):
    out = tmp_path / "cpu.json"
    res = _afd("profile", "--model", "tiny", "--no-exchange", "--calibration-requests", "12",
               "--calibration-rates", "inf", "-o", str(out), timeout=420)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "attention_decode fit" in res.stderr and "calibration:" in res.stderr
    data = json.loads(out.read_text())
    cal = data["calibration"]
    assert cal["fit"]["rows"] and cal["fit"]["server"].startswith("afd serve")
    # how much serving adds to the kernels depends on how loaded this host is; only its form is fixed
    costs = [cal[k] for k in ("step_s", "token_s", "request_s", "held_s", "arrival_s", "front_end_s")]
    assert all(math.isfinite(c) and c >= 0 for c in costs), cal
    assert all(r["measured"] > 0 for r in cal["fit"]["rows"]), cal["fit"]
    sim = _afd("simulate", "--model", "tiny", "--profile", str(out), "--requests", "50", "--short-len", "32",
               "--long-len", "256", "--max-tokens", "16", timeout=90)  # fmt: skip
    assert sim.returncode == 0, sim.stderr[-2000:]
    # the rows it was fitted to travel with it: fitted again, by the same code, they give the same profile
    assert data["measured"]["parts"]["decode"] and data["measured"]["calibration"]["runs"]
    again = tmp_path / "again.json"
    res = _afd("profile", "--refit", str(out), "-o", str(again), timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    refit = json.loads(again.read_text())
    assert refit["parts"] == data["parts"] and refit["calibration"] == data["calibration"]


def test_profile_refuses_a_bad_calibration_flag(tmp_path):
    res = _afd("profile", "--model", "tiny", "--calibration-requests", "0", "-o", str(tmp_path / "x.json"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("afd profile: error:") or "error" in res.stderr
