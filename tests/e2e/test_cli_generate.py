"""`afd generate` as a user runs it: the exact JSON contract, and one sentence with exit 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from afd.engine.generate import generate


def run_afd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_generate_json_contract_matches_the_library() -> None:
    proc = run_afd("generate", "--model", "tiny", "--prompt-ids", "1,2,3;4,5", "--max-new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert list(out) == ["outputs"] and len(out["outputs"]) == 2
    for got, prompt, want in zip(
        out["outputs"], [[1, 2, 3], [4, 5]], generate("tiny", [[1, 2, 3], [4, 5]], max_new_tokens=4), strict=True
    ):
        assert list(got) == ["prompt_ids", "token_ids", "logprobs"]  # prompt_logprobs only when asked for
        assert got["prompt_ids"] == prompt and got["token_ids"] == want.token_ids and len(got["logprobs"]) == 4
        assert all(lp <= 0 for lp in got["logprobs"])


@pytest.mark.timeout(120)
def test_generate_prompts_file_and_prompt_logprobs(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [7, 8, 9]}\n\n{"prompt_ids": [3]}\n')
    proc = run_afd(
        "generate",
        "--model",
        "tiny",
        "--prompts-file",
        str(path),
        "--max-new-tokens",
        "2",
        "--prompt-logprobs",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    outs = json.loads(proc.stdout)["outputs"]
    assert [o["prompt_ids"] for o in outs] == [[7, 8, 9], [3]]
    assert outs[0]["prompt_logprobs"][0] is None and len(outs[0]["prompt_logprobs"]) == 3
    assert outs[1]["prompt_logprobs"] == [None]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope", "--prompt-ids", "1"], "neither a preset"),
        (["--model", "/no/such/dir", "--prompt-ids", "1"], "neither a preset"),
        (["--model", "tiny", "--prompt-ids", "1,2;999"], "outside the vocabulary"),
        (["--model", "tiny", "--prompt-ids", "1,2;"], "is empty"),
        (["--model", "tiny", "--prompt-ids", "1,x"], "must be integers"),
        (["--model", "tiny", "--prompts-file", "/no/such.jsonl"], "prompts file '/no/such.jsonl' does not exist"),
        (["--model", "tiny", "--prompt-ids", "1", "--max-new-tokens", "-1"], "non-negative"),
        (["--model", "tiny", "--prompt-ids", "1", "--attention", "2"], "need a connector"),
        (["--model", "tiny", "--prompt-ids", "1", "--connector", "async", "--gate-on-ffn"], "gate on attention"),
        (["--model", "tiny", "--prompt-ids", "1", "--connector", "mpi"], "invalid choice"),
    ],
)
def test_generate_bad_input_is_one_sentence_and_exit_2(args: list[str], message: str) -> None:
    proc = run_afd("generate", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""


@pytest.mark.timeout(60)
def test_launch_needs_a_connector_and_worker_checks_its_rank() -> None:
    proc = run_afd("launch", "--model", "tiny", "--prompt-ids", "1")
    assert proc.returncode == 2 and "needs --connector" in proc.stderr
    proc = run_afd("worker", "--role", "ffn", "--rank", "3", "--ffn", "2", "--model", "tiny")
    assert proc.returncode == 2 and "out of range" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_prompts_file_with_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_ids": [1]}\n{"ids": [2]}\n')
    proc = run_afd("generate", "--model", "tiny", "--prompts-file", str(path))
    assert proc.returncode == 2 and "line 2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
