"""The vLLM adapter (`afd[vllm]`): vLLM runs attention (its scheduler, paged cache, API server) and hands
every MoE layer to afd FFN ranks (`afd worker --role ffn`) through afd's connectors.

The end-to-end test starts real processes: afd FFN ranks, and vLLM's OpenAI server in a child Python (`vllm.LLM`
offline runs in tests/e2e/test_vllm_docs.py). vLLM starts its engine processes with `spawn`, which a pytest process
cannot host, and its processes must not share this one's fate. It checks that vLLM's greedy tokens equal afd's
single-process reference and `transformers`, that the FFN ranks served work and exited 0 after vLLM told them it was
done, and that no process or shared-memory segment of theirs is left. Without vLLM it is skipped with the reason;
the checks of what the adapter accepts (`afd.vllm_plugin.checks`, no vLLM needed) run everywhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers.e2e import afd_worker, kill_all, mapped_windows
from helpers.hf import spread_weights
from helpers.vllm_shapes import SHAPES

from afd.engine.generate import generate
from afd.runtime.launch import free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_installed() -> str:
    """vLLM's version; skips (saying so) when vLLM cannot be imported. Imported only where a test needs it."""
    try:
        import vllm

        return vllm.__version__
    except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to skip, said out loud
        why = f"{type(exc).__name__}: {exc}"
        pytest.skip(f"VLLM ADAPTER NOT TESTED: vLLM cannot be imported ({why}); pip install -e '.[vllm]'")


PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 19, 23, 11], [4, 8], [100, 3, 77, 12, 9, 250], [1]]
MAX_TOKENS = 5
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's CPU MLA path raises its budget to at least this; the FFN ranks must agree
ENGINE = dict(  # vLLM's arguments; tiny and float32 so its tokens can equal transformers'
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=128,
    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    kv_cache_memory_bytes=64 << 20,  # else vLLM's CPU backend takes most of the host's memory
    # vLLM picks its AMX MLA kernels on a CPU with AMX tiles, and they refuse the tiny model's 16-wide heads
    # ("invalid weight input features 16"); the reference CPU backend takes any shape, on any x86 host
    attention_backend="CPU_MLA",
)
KINDS = {  # grouped top-k with a scaling factor (V2); the V3 correction bias, sigmoid, normalized weights
    "v2": dict(
        q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=2.0
    ),
    "v3": dict(q_lora_rank=32, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
}
ARCH = {"v2": "AFDDeepseekV2ForCausalLM", "v3": "AFDDeepseekV3ForCausalLM"}


# ---------------------------------------------------------------- end to end through vLLM
def _checkpoint(kind: str, path: Path) -> list[list[int]]:
    """A random DeepSeek checkpoint saved by transformers; returns transformers' greedy tokens for PROMPTS."""
    transformers = pytest.importorskip("transformers")
    cfg_cls, model_cls = (
        (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
        if kind == "v2"
        else (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
    )
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**SHAPES, **KINDS[kind])).eval()
    spread_weights(model)
    with torch.no_grad():
        model.save_pretrained(path)
        greedy = []
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            greedy.append(ids[len(prompt) :])
    return greedy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]]]]:
    """kind -> (checkpoint directory, greedy tokens), checked equal between transformers and afd's reference."""
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        hf_tokens = _checkpoint(kind, path)
        afd_tokens = [o.token_ids for o in generate(path, PROMPTS, max_new_tokens=MAX_TOKENS)]
        assert afd_tokens == hf_tokens, f"{kind}: afd's reference and transformers disagree"
        out[kind] = (path, hf_tokens)
    return out


class Run:
    """The FFN ranks of one AFD world and what the test watches of them: their shared-memory windows (the async
    ones are named by a token vLLM's rank mints) and their exit."""

    def __init__(self, connector: str, num_ffn: int, model: Path) -> None:
        self.afd = {"connector": connector, "port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": num_ffn}
        extra = ("--model", str(model), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--run-token", "afd")
        self.ffn = [afd_worker(self.afd, "ffn", f, *extra) for f in range(num_ffn)]
        self.windows: set[str] = set()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._record_windows, daemon=True)
        self._watch.start()

    def _record_windows(self) -> None:
        while not self._stop.wait(0.05):
            for proc in self.ffn:
                self.windows |= mapped_windows(proc.pid)

    def finish(self, timeout_s: float = 60) -> list[str]:
        """Wait for every FFN rank to exit; their logs. Asserts exit 0 and that nothing of theirs is in /dev/shm."""
        logs = []
        for f, proc in enumerate(self.ffn):
            _, err = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, f"ffn rank {f} exited {proc.returncode}: {err[-3000:]}"
            logs.append(err)
        self._stop.set()
        self._watch.join(2)
        assert not [w for w in self.windows if os.path.exists(f"/dev/shm/{w}")], "shared-memory windows left behind"
        return logs

    def kill(self) -> None:
        self._stop.set()
        kill_all(self.ffn)


def _served(connector: str, log: str) -> int:
    """Work items (async) or steps (p2p) an FFN rank logged at its end."""
    pattern = r"after (\d+) work items" if connector == "async" else r"served (\d+) steps"
    found = re.search(pattern, log)
    assert found, f"no count of served work in the FFN log: {log[-2000:]}"
    return int(found.group(1))


def _group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and every vLLM process it started (own session)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _post(url: str, body: dict, timeout_s: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the vLLM server exited: {log.read_text()[-6000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the vLLM server was not healthy within {timeout_s} s")


@pytest.mark.timeout(300)
def test_vllm_openai_server_over_p2p(vllm_installed, checkpoints, tmp_path):
    """vLLM's OpenAI server (what `vllm serve` runs) with V3's afd architecture over p2p with 2 FFN ranks (the
    expert all-to-all between them): idle longer than a keep-alive period (the FFN ranks keep getting zero-token
    steps), then one HTTP request of every prompt, whose greedy tokens equal afd's reference and transformers';
    SIGTERM ends vLLM and the FFN ranks cleanly. (V2's architecture over async, offline and served, runs in
    tests/e2e/test_vllm_docs.py.)"""
    path, want = checkpoints["v3"]
    run = Run("p2p", 2, path)
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--port", str(port)]
    cmd += ["--hf-overrides", json.dumps({"architectures": [ARCH["v3"]]}), "--additional-config"]
    cmd += [json.dumps({"afd": run.afd}), "--shutdown-timeout", "5"]  # time for the workers to say goodbye
    for key, value in ENGINE.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    log = tmp_path / "vllm_server.log"  # a file, not a pipe: nobody reads while it serves, and it logs a lot
    with open(log, "w") as sink:
        server = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", server, log, 240)
        time.sleep(3)  # > the keep-alive period (2 s): the p2p FFN rank must get zero-token steps meanwhile
        body = {
            "model": str(path),
            "prompt": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        answer = _post(f"http://127.0.0.1:{port}/v1/completions", {**body, "return_token_ids": True})
        assert [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])] == want
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        out = log.read_text()
        idle = re.search(r"(\d+) idle steps; closing \(cleanly\)", out)
        assert idle and int(idle.group(1)) > 0, out[-4000:]
        assert _group_gone(server.pid, 30), "vLLM processes left running"
        logs = run.finish()
        assert len(logs) == 2 and all(_served("p2p", log) > int(idle.group(1)) for log in logs)  # idle + request
    finally:
        _kill_group(server)
        run.kill()
