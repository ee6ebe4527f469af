"""Requests that arrive into running replicas: the engine's stop tokens, aborts and per-step tokens, the online
loop (`afd.runtime.online`) in process, and real servers (`start_server_ranks`) driven by a fake front end
through the real link: a `none` replica, async 1A1F, p2p 1A1F and 2A1F."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import pytest
from helpers.e2e import MODEL, PROMPTS, TEST_TAG_VAR, TOLERANCE, Leftovers, worker_pids

from afd.config import parse_config
from afd.engine.generate import generate
from afd.model.kv_cache import CacheOptions
from afd.runtime.launch import free_port
from afd.runtime.link import FrontLink
from afd.runtime.servers import ServerRanks, new_secret, start_server_ranks
from afd.runtime.spec import RunSpec

LONG = [3, 1, 4, 1, 5, 9, 2, 6]  # the request that runs while the others arrive


# ---------------------------------------------------------------- real servers, a fake front end
SPEC = RunSpec(model=MODEL, max_num_batched_tokens=32, cache=CacheOptions(num_blocks=256))  # 4096 cache tokens
TOPOLOGIES = {"none": (None, 1, 1), "async-1A1F": ("async", 1, 1), "p2p-1A1F": ("p2p", 1, 1), "p2p-2A1F": ("p2p", 2, 1)}


@dataclass
class FakeFrontEnd:
    """What a front end keeps per request: the tokens streamed, how it finished, each replica's last load."""

    ranks: ServerRanks
    link: FrontLink
    tag: str
    leftovers: Leftovers
    replicas: int
    tokens: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, dict] = field(default_factory=dict)
    loads: dict[int, list[dict]] = field(default_factory=lambda: defaultdict(list))
    byes: set[int] = field(default_factory=set)

    def add(self, replica: int, rid: str, prompt: list[int], max_tokens: int, **fields) -> None:
        self.link.conns[replica].send(
            {"type": "add", "rid": rid, "prompt_ids": prompt, "max_tokens": max_tokens, "sampling": {}, **fields}
        )

    def send(self, replica: int, message: dict) -> None:
        self.link.conns[replica].send(message)

    def pump(self, until: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
        """Read every replica's messages until `until()` holds; fail after `timeout_s`, naming dead ranks."""
        import time

        deadline = time.monotonic() + timeout_s
        by_conn = {conn: r for r, conn in self.link.conns.items()}
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}; dead ranks: {self.ranks.dead()}"
            for conn in wait(list(by_conn), timeout=min(left, 1.0)):
                try:
                    self._on(by_conn[conn], conn.recv())
                except EOFError:
                    del by_conn[conn]

    def _on(self, replica: int, msg: dict) -> None:
        if msg["type"] == "tokens":
            for rid, token, logprob in msg["items"]:
                self.tokens[rid].append((token, logprob))
        elif msg["type"] == "finished":
            self.finished[msg["rid"]] = msg
        elif msg["type"] == "load":
            self.loads[replica].append(msg)
        elif msg["type"] == "bye":
            self.byes.add(replica)


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def front(request):
    """One server per topology, shared by the tests below; its processes carry their own test tag."""
    connector, num_attn, num_ffn = TOPOLOGIES[request.param]
    with pytest.MonkeyPatch.context() as mp:
        tag = uuid.uuid4().hex[:12]
        mp.setenv(TEST_TAG_VAR, tag)
        leftovers = Leftovers()
        secret = new_secret()
        link = FrontLink(secret.encode())
        config = None
        if connector is not None:
            raw = {"connector": connector, "num_attention_ranks": num_attn, "num_ffn_ranks": num_ffn}
            config = parse_config({**raw, "port": free_port(), "connector_extra_config": {"timeout_s": 60}})
        ranks = start_server_ranks(config, SPEC, num_attn, link.address, secret=secret)
        try:
            try:
                link.accept(num_attn, 90)
            except Exception as exc:
                raise AssertionError(f"{exc}; dead ranks: {ranks.dead()}") from None
            worker_pids()  # records the ranks' run tokens under this tag (Leftovers checks their segments)
            yield FakeFrontEnd(ranks, link, tag, leftovers, num_attn)
        finally:
            ranks.stop(5)
            link.close()
            leftovers.cleanup()


def reference_tokens(prompt: list[int], max_tokens: int) -> list[tuple[int, float]]:
    (out,) = generate(MODEL, [prompt], max_new_tokens=max_tokens)
    return list(zip(out.token_ids, out.logprobs, strict=True))


def assert_same_tokens(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want], "greedy tokens differ from afd.engine.generate.generate"
    assert all(abs(a - b) <= TOLERANCE for (_, a), (_, b) in zip(got, want, strict=True))


@pytest.mark.timeout(180)
def test_requests_added_while_others_run_match_generate(front: FakeFrontEnd):
    front.add(0, "long", LONG, 48)
    front.pump(lambda: len(front.tokens["long"]) >= 2, what="the first tokens of the long request")
    for i, prompt in enumerate(PROMPTS):  # spread over the replicas while "long" runs on replica 0
        front.add(i % front.replicas, f"p{i}", prompt, 6)
    assert "long" not in front.finished
    names = ["long", *(f"p{i}" for i in range(len(PROMPTS)))]
    front.pump(lambda: all(n in front.finished for n in names), what="every request to finish")
    assert {n: front.finished[n]["reason"] for n in names} == dict.fromkeys(names, "length")
    assert_same_tokens(front.tokens["long"], reference_tokens(LONG, 48))
    for i, prompt in enumerate(PROMPTS):
        assert_same_tokens(front.tokens[f"p{i}"], reference_tokens(prompt, 6))


@pytest.mark.timeout(60)
def test_stop_token_ends_with_reason_stop(front: FakeFrontEnd):
    want = reference_tokens(PROMPTS[0], 8)
    stop = want[3][0]
    cut = [t for t, _ in want].index(stop) + 1
    front.add(front.replicas - 1, "stop", PROMPTS[0], 8, stop_token_ids=[stop])
    front.pump(lambda: "stop" in front.finished, what="the request with a stop token")
    assert front.finished["stop"]["reason"] == "stop"
    assert_same_tokens(front.tokens["stop"], want[:cut])


@pytest.mark.timeout(60)
def test_abort_frees_the_cache(front: FakeFrontEnd):
    loads = front.loads[0]
    front.add(0, "endless", LONG, 3000)
    front.pump(lambda: front.tokens["endless"] and loads and loads[-1]["cache_usage"] > 0, what="the request to run")
    assert loads[-1]["running"] == 1
    front.send(0, {"type": "abort", "rid": "endless"})
    front.pump(lambda: "endless" in front.finished, what="the abort")
    assert front.finished["endless"]["reason"] == "abort"
    front.pump(lambda: loads[-1]["running"] == 0 and loads[-1]["cache_usage"] == 0.0, what="the cache to be freed")
    assert len(front.tokens["endless"]) < 3000


@pytest.mark.timeout(60)
def test_bad_request_gets_error_and_the_replica_keeps_serving(front: FakeFrontEnd):
    replica = front.replicas - 1
    front.add(replica, "bad", [1, 2, 999_999], 4)
    front.add(replica, "too-long", LONG, 5000)  # more than the 4096-token cache holds
    front.add(replica, "after", PROMPTS[3], 4)
    front.pump(lambda: {"bad", "too-long", "after"} <= set(front.finished), what="the three requests")
    assert front.finished["bad"]["reason"] == "error" and "vocabulary" in front.finished["bad"]["message"]
    assert front.finished["too-long"]["reason"] == "error"
    assert front.finished["after"]["reason"] == "length"
    assert_same_tokens(front.tokens["after"], reference_tokens(PROMPTS[3], 4))


@pytest.mark.timeout(60)
def test_shutdown_ends_every_rank_cleanly(front: FakeFrontEnd, monkeypatch: pytest.MonkeyPatch):
    """Last for each server: a request still running is aborted, every replica says bye, every rank exits 0
    and nothing is left. p2p 2A1F is stopped by SIGTERM alone (`ServerRanks.stop`), the others by `shutdown`."""
    front.add(0, "cut-short", LONG, 3000)
    front.pump(lambda: bool(front.tokens["cut-short"]), what="the last request to run")
    by_signal = front.replicas == 2
    if not by_signal:
        for r in range(front.replicas):
            front.send(r, {"type": "shutdown"})
        front.pump(lambda: len(front.byes) == front.replicas, what="every replica's bye")
    codes = front.ranks.stop(10)
    front.pump(lambda: len(front.byes) == front.replicas and "cut-short" in front.finished, 5, "the byes")
    assert front.finished["cut-short"]["reason"] == "abort"
    assert codes == dict.fromkeys(front.ranks.names, 0), front.ranks.dead()
    monkeypatch.setenv(TEST_TAG_VAR, front.tag)
    front.leftovers.check()
    assert not front.ranks.run_dir.exists()
