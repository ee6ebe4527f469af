"""The sorting and the summary of `afd bench serve --chaos` (`afd.bench.chaos`, `afd.bench.chaos_run`) on answers
written by hand: every kind of end a request can have, and which failures name a killed rank."""

from __future__ import annotations

import json

import pytest

from afd.bench.chaos import Kill, Outcome, classify, names_rank, rank_name
from afd.bench.chaos_run import format_chaos, poisson_arrivals, summarize


def _whole(ids: list[int]) -> str:
    return json.dumps({"choices": [{"logprobs": {"tokens": [f"token_id:{i}" for i in ids]}}]})


def _stream(ids: list[int], error: str | None = None, done: bool = True) -> str:
    events = [{"choices": [{"logprobs": {"tokens": [f"token_id:{i}"]}}]} for i in ids]
    events += [{"error": {"message": error}}] if error else []
    events += [{"choices": [], "usage": {"completion_tokens": len(ids)}}]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if done else "")


def test_classify_every_kind_of_end():
    assert classify(200, None, _whole([3, 4]), False, [3, 4]).kind == "right"
    assert classify(200, None, _whole([3, 5]), False, [3, 4]).kind == "wrong"
    assert classify(200, None, _stream([3, 4]), True, [3, 4]).kind == "right"
    assert classify(200, None, _stream([3, 4]), True, None) == Outcome("unchecked", streamed=True, token_ids=[3, 4])
    died = classify(200, None, _stream([3], "replica 1 exited with status -9"), True, [3, 4])
    assert died.kind == "failed" and died.error == "replica 1 exited with status -9"
    assert classify(200, None, _stream([3], done=False), True, [3]).kind == "failed"
    body = json.dumps({"error": {"message": "no replica serves"}})
    assert classify(503, "1", body, False, [3]).kind == "refused"
    assert classify(503, None, body, False, [3]) == Outcome("failed", "no replica serves")
    assert classify(502, None, "<html>bad gateway</html>", False, [3]).kind == "failed"  # not JSON: still sorted


def test_failures_name_the_killed_rank_or_are_stray():
    assert names_rank("replica 1 exited with status -9 (killed by SIGKILL)", rank_name("replica", 1))
    assert not names_rank("replica 1 was drained for a restart and did not finish", "replica 1")
    ffn = "ffn rank 0 (world rank 2) exited with status -9 (killed by SIGKILL)"
    assert names_rank(ffn, rank_name("ffn", 0)) and not names_rank(ffn, rank_name("ffn", 1))
    kills = [Kill("replica 1", 3.0, 0.9), Kill("ffn rank 0", 8.0, 2.5), Kill("replica 0", 14.0, None)]
    outcomes = [Outcome("right"), Outcome("right"), Outcome("wrong"), Outcome("hung"), Outcome("refused"),
                Outcome("failed", "replica 1 exited with status -9"), Outcome("failed", ffn),
                Outcome("failed", "connection: reset")]  # fmt: skip
    got = summarize(outcomes, kills, checked=True)
    assert (got["completed"], got["failed"], got["wrong"], got["hung"], got["refused"]) == (2, 3, 1, 1, 1)
    assert got["stray_failures"] == ["connection: reset"] and got["not_healed"] == 1
    assert got["heal_p50_s"] == pytest.approx(1.7) and got["heal_max_s"] == 2.5
    assert "not healed" in format_chaos("x", got)


def test_poisson_arrivals_are_seeded_and_within_the_run():
    arrivals = poisson_arrivals(4.0, 100.0, seed=1)
    assert arrivals == poisson_arrivals(4.0, 100.0, seed=1) and arrivals == sorted(arrivals)
    assert 300 < len(arrivals) < 500 and arrivals[-1] < 100.0


def test_the_server_behind_a_port_is_found_by_its_listening_socket():
    """`--chaos --url`: the ranks to kill are found through the pid of the process that listens on the port."""
    import os
    import socket

    from afd.bench.chaos import rank_pids, server_pid_of

    with socket.create_server(("127.0.0.1", 0)) as sock:
        assert server_pid_of(sock.getsockname()[1]) == os.getpid()
    assert rank_pids(os.getpid()) == {}  # this process launched no rank
