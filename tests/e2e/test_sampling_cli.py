"""Sampling as a user runs it: a bad flag from the shell is one sentence and exit 2, and a launched p2p run samples
exactly as the single process does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.e2e import Leftovers

from afd.engine.generate import generate
from afd.engine.sampling import SamplingParams

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [4, 8], [100, 3, 77, 12]]
NEW = 8


def test_a_bad_flag_from_the_shell_is_one_sentence_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "afd", "generate", "--model", "tiny", "--prompt-ids", "1", "--top-p", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "afd: error: argument --top-p: top_p must be a number greater than 0 and at most 1, got 2.0"
    ]


# ---------------------------------------------------------------- end to end
FLAGS = ["--temperature", "0.8", "--sampling-seed", "7"]


def afd_json(*args: str) -> list[list[int]]:
    proc = subprocess.run([sys.executable, "-m", "afd", *args, "--json"], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]]


@pytest.mark.timeout(240)
def test_a_launched_p2p_run_samples_like_the_single_process() -> None:
    """`afd generate` and `afd launch --connector p2p` 1A1F with the same sampling flags: the same tokens as
    the library; and the flags took effect (not the greedy tokens)."""
    prompt_ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
    common = ["--model", "tiny", "--dtype", "float32", "--prompt-ids", prompt_ids, "--max-new-tokens", str(NEW)]
    want = [o.token_ids for o in generate("tiny", PROMPTS, max_new_tokens=NEW, sampling=SamplingParams(0.8, seed=7))]
    assert want != [o.token_ids for o in generate("tiny", PROMPTS, max_new_tokens=NEW)]
    assert afd_json("generate", *common, *FLAGS) == want
    leftovers = Leftovers()
    try:
        launched = afd_json("launch", *common, *FLAGS, "--connector", "p2p", "--attention", "1", "--ffn", "1")
        assert launched == want
        leftovers.check()
    finally:
        leftovers.cleanup()
