"""The real `afd serve --model tiny` as a subprocess on a free port, one server per connector config for the
module (none R=2, async 1A1F; p2p in `test_serve_isolation`): greedy completions equal the reference
engine (`afd generate`'s), streams equal whole answers, concurrent streams all finish, SIGTERM ends
everything (exit 0, no rank, no shared-memory segment). Killed ranks: `test_serve_isolation`."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers.e2e import TEST_TAG_VAR, Leftovers, worker_pids
from helpers.http_client import http_request, sse_events, token_ids

from afd.runtime.launch import free_port
from afd.serve.run import ServerProcess

MODEL = "tiny"
PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 19, 23, 11], [4, 8], [100, 3, 77, 12, 9, 250]]
MAX_TOKENS = 5
CONFIGS = {  # a module-scoped server each; p2p 1A1F is served by test_serve_isolation (CI time: ~20 s per server)
    "none-R2": ["--connector", "none", "--replicas", "2"],
    "async-1A1F": ["--connector", "async", "--attention", "1", "--ffn", "1"],
}
SMALL = ["--max-num-seqs", "16", "--max-model-len", "512", "--max-num-batched-tokens", "512"]


class Served:
    """One `afd serve` under its own test tag, with the bookkeeping that proves it left nothing behind."""

    def __init__(self, flags: list[str], tag: str) -> None:
        self.tag, self._previous_tag = tag, os.environ.get(TEST_TAG_VAR)
        os.environ[TEST_TAG_VAR] = tag  # the ranks inherit it: Leftovers sees exactly this server's processes
        self.leftovers = Leftovers()
        self.port = free_port()
        self.server = ServerProcess(["--model", MODEL, "--port", str(self.port), *SMALL, *flags], timeout_s=120)
        self.workers = worker_pids()  # also records their shared-memory run tokens

    def close(self) -> None:
        os.environ[TEST_TAG_VAR] = self.tag
        try:
            self.server.stop(timeout_s=5)
        finally:
            self.leftovers.cleanup()
            if self._previous_tag is None:
                os.environ.pop(TEST_TAG_VAR, None)
            else:
                os.environ[TEST_TAG_VAR] = self._previous_tag


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request):
    srv = Served(CONFIGS[request.param], f"serve{request.param}{os.getpid()}")
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def reference():
    from afd.engine.generate import generate

    return generate(MODEL, PROMPTS, max_new_tokens=MAX_TOKENS)


@pytest.mark.timeout(180)
def test_completions_equal_generate_and_streams_equal_whole_answers(served, reference):
    body = {
        "model": MODEL,
        "prompt": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    status, got, _ = http_request(served.port, "POST", "/v1/completions", body)
    assert status == 200, got
    for choice, out in zip(got["choices"], reference, strict=True):
        assert token_ids(choice) == out.token_ids
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(out.logprobs, abs=1e-4)
    events = sse_events(served.port, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    for i, out in enumerate(reference):
        ids = [
            int(e["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
            for e in events[:-1]
            if e["choices"][0]["index"] == i and e["choices"][0]["logprobs"]
        ]
        assert ids == out.token_ids
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    status, whole, _ = http_request(served.port, "POST", "/v1/chat/completions", chat)
    streamed = sse_events(served.port, "/v1/chat/completions", chat)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[:-1])
    assert status == 200 and text == whole["choices"][0]["message"]["content"]


@pytest.mark.timeout(180)
def test_concurrent_streams_all_finish(served):
    results: list[list] = []

    def one(i: int) -> None:
        body = {
            "prompt": [i + 1] * (3 + 7 * (i % 3)),
            "max_tokens": 8,
            "temperature": 0.8,
            "seed": i,
            "stream_options": {"include_usage": True},
        }
        results.append(sse_events(served.port, "/v1/completions", body))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 16
    for events in results:
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
    assert http_request(served.port, "GET", "/health")[0] == 200


@pytest.mark.timeout(180)
def test_sigterm_stops_the_server_and_every_rank(served, monkeypatch):
    monkeypatch.setenv(TEST_TAG_VAR, served.tag)
    assert served.workers, "the server's ranks were not seen"
    started = time.monotonic()
    served.server.proc.send_signal(signal.SIGTERM)
    code = served.server.proc.wait(25)
    assert code == 0 and time.monotonic() - started < 20
    served.leftovers.check()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(180)
def test_busy_poll_serves_the_same_answers_and_spins_while_idle(monkeypatch, reference):
    """`--busy-poll`: an idle replica polls its link without sleeping (its CPU time grows while nothing is asked;
    without the flag it would block), answers stay the reference's, and SIGTERM still leaves nothing behind."""
    srv = Served(["--connector", "none", "--busy-poll"], f"servebusy{os.getpid()}")
    try:
        monkeypatch.setenv(TEST_TAG_VAR, srv.tag)
        (replica,) = srv.workers
        before, started = cpu_seconds(replica), time.monotonic()
        time.sleep(1.0)
        spun = (cpu_seconds(replica) - before) / (time.monotonic() - started)
        assert spun > 0.3, f"an idle busy-polling replica used only {spun:.0%} of a core"
        body = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}  # fmt: skip
        status, got, _ = http_request(srv.port, "POST", "/v1/completions", body)
        assert status == 200 and token_ids(got["choices"][0]) == reference[2].token_ids
        srv.server.proc.send_signal(signal.SIGTERM)
        assert srv.server.proc.wait(25) == 0
        srv.leftovers.check()
    finally:
        srv.close()


@pytest.mark.timeout(180)
def test_micro_batched_async_serves_the_reference_answers(monkeypatch, tmp_path, reference):
    """`--ubatches 2`: a step of several prompts runs as two micro-batches in ping-pong on the attention rank, the
    answers stay the reference's, and the rank says how many of its steps were split."""
    monkeypatch.setenv("AFD_LOG_DIR", str(tmp_path))  # the rank logs stay for the count below
    flags = ["--connector", "async", "--attention", "1", "--ffn", "1", "--ubatches", "2"]
    srv = Served(flags, f"serveubatch{os.getpid()}")
    try:
        body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}  # fmt: skip
        status, got, _ = http_request(srv.port, "POST", "/v1/completions", body)
        assert status == 200, got
        assert [token_ids(c) for c in got["choices"]] == [out.token_ids for out in reference]
        srv.server.proc.send_signal(signal.SIGTERM)
        assert srv.server.proc.wait(25) == 0
    finally:
        srv.close()
    logs = "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    split = re.search(r"attention rank 0: (\d+) steps ran as micro-batches while serving", logs)
    assert split and int(split.group(1)) >= 1, logs[-2000:]
