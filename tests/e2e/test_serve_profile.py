"""`afd bench serve --profile` run as a user runs it on the tiny model: the server it starts gets the budget the profile
picks for its topology, a flag given beside it wins, and the choice is said once and kept in the raw JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.e2e import Leftovers

from afd.model.weights import load_model_config
from afd.planning import costs
from afd.planning.deployment import Deployment
from afd.planning.profile import Part, Profile, load_profile
from afd.planning.recommend import recommend

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_MODEL_LEN = 256


def _profile(path: Path) -> Path:
    """A CPU profile of the tiny model, in the format `afd profile` writes."""
    parts = {
        "attention_decode": Part(fixed_s=2e-3, bandwidth_Bps=1e9),
        "prefill": Part(peak_flops=1e10),
        "routed_experts": Part(fixed_s=1e-4, bandwidth_Bps=1e9, peak_flops=1e10),
        "shared_experts": Part(fixed_s=1e-4, bandwidth_Bps=1e9, peak_flops=1e10),
        "host": Part(fixed_s=1e-3),
    }
    Profile({"device": "cpu (x86_64)", "model": "tiny"}, parts, "test", "float32", 16e9).save(path)
    return path


@pytest.mark.timeout(150)
def test_bench_serve_starts_its_server_with_the_profiles_budget(tmp_path: Path) -> None:
    profile = _profile(tmp_path / "cpu.json")
    shapes = costs.shapes_of(load_model_config("tiny"), "float32")
    picked = recommend(
        load_profile(profile), shapes, Deployment("none", max_num_seqs=8), source=str(profile), max_model_len=256
    ).max_num_batched_tokens
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(f'{{"prompt_len": {n}, "max_tokens": 3}}\n' for n in (9, 30, 4)))
    out = tmp_path / "out.json"
    argv = ["bench", "serve", "--model", "tiny", "--profile", str(profile), "--trace", str(trace), "--rates", "inf"]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--warmups", "0", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    leftovers = Leftovers()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "afd", *argv], capture_output=True, text=True, timeout=130, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = f"none R=1: max_num_batched_tokens {picked} (profile {profile}), max_num_seqs 8 (flag)\n"
        assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
        result = json.loads(out.read_text())["results"][0]
        assert result["step_limits"]["max_num_batched_tokens"] == picked
        assert result["step_limits"]["from"]["max_num_seqs"] == "flag"
        assert result["runs"][0]["summary"]["errors"] == 0
        leftovers.check()
    finally:
        leftovers.cleanup()
