"""`afd config` and `afd topology` run as a user runs them: the resolved JSON, the topology's shape, and rejections in
one sentence."""

import json
import subprocess
import sys

import pytest
from helpers.config_cases import WRAPPED


def run_afd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=60)


def test_cli_config_prints_resolved_json() -> None:
    proc = run_afd("config", json.dumps(WRAPPED))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["connector"] == "async" and out["role"] == "ffn" and out["port"] == 7000
    assert out["connector_extra_config"]["ring_depth"] == 2
    assert out["connector_extra_config"]["routed_cap_multiplier"] == 2.0


@pytest.mark.parametrize(
    "arg, message",
    [
        ('{"connector": "async", "compute_gate_on_attention": false}', "gate on attention"),
        ('{"port": 0}', "port must be between"),
        ("/no/such/file.json", "does not exist"),
    ],
)
def test_cli_config_rejects_with_one_sentence(arg: str, message: str) -> None:
    proc = run_afd("config", arg)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_topology_json_shape() -> None:
    proc = run_afd("topology", "--attention", "2", "--ffn", "3", "--tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "attention": 2,
        "ffn": 3,
        "groups": [{"attention": [0], "ffn": [0, 1]}, {"attention": [1], "ffn": [2]}],
        "splits": {"0": [3, 2], "1": [5]},
    }
    human = run_afd("topology", "--attention", "3", "--ffn", "2")
    assert human.returncode == 0 and "group 1: [A2] <-> [F1]" in human.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--attention", "0", "--ffn", "2"],
        ["--attention", "-3", "--ffn", "2"],
        ["--attention", "1.5", "--ffn", "2"],
        ["--attention", "2", "--ffn", "2", "--tokens", "-1"],
        ["--attention", "2"],
    ],
)
def test_cli_topology_bad_arguments(args: list[str]) -> None:
    proc = run_afd("topology", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
