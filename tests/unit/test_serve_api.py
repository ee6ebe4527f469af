"""`afd serve`'s HTTP side without processes: the pure parts (protocol models, router, tokenizer, metrics, SSE) and
the real server (FastAPI on uvicorn, real sockets) over in-process replicas (`helpers.serve.InProcessServer`), so
greedy tokens can be compared with `afd.engine.generate.generate` in seconds."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest
from helpers.http_client import token_ids
from helpers.serve import MODEL, InProcessServer

from afd.serve import metrics
from afd.serve.balancer import outstanding_tokens, pick_replica
from afd.serve.output import OutputText
from afd.serve.protocol import APIError, parse_chat, parse_completion, sse
from afd.serve.tokenizer import ByteTokenizer, IncrementalDecoder


# ---------------------------------------------------------------- pure parts
def test_router_fewest_outstanding_tokens_ties_lowest_index():
    assert pick_replica([5, 3, 3]) == 1
    assert pick_replica([0, 0]) == 0
    assert pick_replica([1, 9, 0], alive=[True, True, False]) == 0
    with pytest.raises(ValueError):
        pick_replica([1, 2], alive=[False, False])
    assert outstanding_tokens(prompt_len=100, max_tokens=10, generated=0) == 110  # the prompt counts until prefilled
    assert outstanding_tokens(prompt_len=100, max_tokens=10, generated=4) == 6


def test_byte_tokenizer_round_trip_and_utf8_holdback():
    tok = ByteTokenizer(256)
    text = "héllo → 世界 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.stop_token_ids == []  # tiny: 256 ids, all bytes, no EOS
    decoder = tok.decoder()
    pieces = [decoder.push(t) for t in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # an incomplete character is held back, never broken
    assert pieces[ids.index(0xF0)] == ""  # the first byte of the 4-byte emoji releases nothing
    big = ByteTokenizer(1000)
    assert big.stop_token_ids == [256] and big.decode([104, 105, 256]) == "hi"
    assert big.decode([300]) == "<|300|>" and big.token_text(0xE4) == "<0xE4>" and big.token_text(65) == "A"
    with pytest.raises(ValueError, match="byte-level vocabulary of 100"):
        ByteTokenizer(100).encode("é")


def test_incremental_decoder_holds_back_incomplete_characters():
    """The window decoder of checkpoint tokenizers, over a decode that sees bytes (as byte-level BPE does)."""

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    ids = list("añ世🙂".encode())
    decoder = IncrementalDecoder(decode)
    pieces = [decoder.push(t) for t in ids]
    assert "".join(pieces) + decoder.flush() == "añ世🙂" and all("\ufffd" not in p for p in pieces)


def test_a_checkpoint_tokenizer_its_chat_template_and_eos(tmp_path):
    """A byte-level BPE `tokenizer.json` with a chat template, as a checkpoint directory ships it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from afd.serve.tokenizer import HFTokenizer, load_tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet)
    bpe.train_from_iterator(["hello world, héllo wörld 世界"] * 20, trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    tok = load_tokenizer(str(tmp_path), 512)
    assert isinstance(tok, HFTokenizer) and tok.stop_token_ids == [1, 7]
    text = "héllo 世界, hello"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    decoder = tok.decoder()
    pieces = [decoder.push(t) for t in ids]
    assert "".join(pieces) + decoder.flush() == text and all("\ufffd" not in p for p in pieces)
    assert tok.decode(tok.chat_prompt([{"role": "user", "content": "hi"}])) == "<user>hi\n<assistant>"


def test_stop_strings_cut_the_text_and_hold_back_partial_matches():
    tok = ByteTokenizer(256)
    out = OutputText(tok, ["END", "\n\n"])
    released = [out.add(t) for t in tok.encode("abc EN")]
    assert "".join(released) == "abc " and not out.stopped  # "EN" may begin "END": held back
    assert out.add(ord("X")) == "ENX"  # it did not
    released = [out.add(t) for t in tok.encode("yz END more")]
    assert out.stopped and out.text == "abc ENXyz " and "".join(released) == "yz "
    plain = OutputText(tok, [])
    assert "".join(plain.add(t) for t in tok.encode("abc")) + plain.finish() == "abc"


def test_protocol_validation_and_error_object():
    req = parse_completion({"model": "m", "prompt": [[1, 2], "hi"], "max_tokens": 3, "temperature": 0, "stop": "x"})
    params = req.generation()
    assert req.prompts() == [[1, 2], "hi"] and params.stop == ["x"] and params.sampling.greedy
    assert parse_completion({"prompt": "a", "top_k": -1}).generation().sampling.top_k == 0  # vLLM's -1: off
    assert parse_completion({"prompt": "a", "unknown": {"x": 1}}).prompts() == ["a"]  # unknown fields: ignored
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "logprobs": True})
    assert chat.chat() == [{"role": "user", "content": "hi"}] and chat.generation().logprobs == 0
    cases = [
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "logprobs": 5}, "logprobs"),
        ({"prompt": "a", "stop": [1]}, "stop"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),  # strict: a string is not a number
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ]
    for body, param in cases:
        with pytest.raises(APIError) as info:
            parse_completion(body).generation()
        err = info.value.body()["error"]
        assert (info.value.status, err["param"], err["code"], err["type"]) == (400, param, 400, "BadRequestError")
        assert err["message"].count(". ") == 0  # one sentence
    with pytest.raises(APIError, match="JSON object"):
        parse_completion([1, 2])
    with pytest.raises(APIError, match="messages"):
        parse_chat({"messages": []})
    with pytest.raises(APIError, match=r"messages\[0\]\.content may hold only text parts"):
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})


def test_metrics_through_prometheus_client():
    """The page parses as the Prometheus text format and keeps the metric names of the README."""
    from prometheus_client.parser import text_string_to_metric_families

    served = metrics.ServeMetrics(2)
    m = served.replicas[0]
    m.running.set(2)
    m.cache_usage.set(0.25)
    m.graphs_captured.set(3)
    m.generation_tokens.inc(7)
    m.ttft.observe(0.003)
    m.ttft.observe(100.0)
    m.finished("stop")
    text = served.render(healthy=True, front_waiting=0).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("afd_num_requests_running", (("replica", "0"),))] == 2
    assert samples[("afd_num_requests_running", (("replica", "1"),))] == 0
    assert samples[("afd_kv_cache_usage_perc", (("replica", "0"),))] == 0.25
    assert samples[("afd_graphs_captured_while_serving", (("replica", "0"),))] == 3
    assert samples[("afd_generation_tokens_total", (("replica", "0"),))] == 7
    assert samples[("afd_time_to_first_token_seconds_bucket", (("le", "0.001"), ("replica", "0")))] == 0
    assert samples[("afd_time_to_first_token_seconds_bucket", (("le", "0.005"), ("replica", "0")))] == 1
    assert samples[("afd_time_to_first_token_seconds_bucket", (("le", "+Inf"), ("replica", "0")))] == 2
    assert samples[("afd_time_to_first_token_seconds_count", (("replica", "0"),))] == 2
    assert samples[("afd_request_success_total", (("finished_reason", "stop"), ("replica", "0")))] == 1
    assert samples[("afd_healthy", ())] == 1 and samples[("afd_front_end_waiting", ())] == 0
    assert samples[("afd_rank_restarts_total", (("replica", "1"),))] == 0
    assert "# TYPE afd_inter_token_latency_seconds histogram" in text.splitlines()
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'


# ---------------------------------------------------------------- the app over in-process replicas
@pytest.fixture(scope="module")
def server():
    srv = InProcessServer(num_replicas=2, max_num_seqs=2, max_waiting=1)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def reference():
    from afd.engine.generate import generate

    prompts = [[5, 17, 33, 2, 9, 41], [4, 8], [100, 3, 77, 12]]
    return prompts, generate(MODEL, prompts, max_new_tokens=6)


@pytest.mark.timeout(120)
def test_greedy_completions_equal_the_reference_engine(server, reference):
    prompts, outputs = reference
    status, body, _ = server.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompts,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == MODEL
    for choice, out in zip(body["choices"], outputs, strict=True):
        assert token_ids(choice) == out.token_ids and choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(out.logprobs, abs=1e-5)
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 18, "total_tokens": 30}


@pytest.mark.timeout(120)
def test_streaming_equals_non_streaming(server):
    body = {"prompt": "Hello, world", "max_tokens": 8, "temperature": 0, "stream_options": {"include_usage": True}}
    status, whole, _ = server.post("/v1/completions", {k: v for k, v in body.items() if k != "stream_options"})
    assert status == 200
    events = server.stream("/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"] == whole["usage"] and events[-2]["choices"] == []
    assert not any("afd_timing" in e for e in events[:-1])  # afd's own field only when asked for
    timed = server.stream("/v1/completions", {**body, "afd_timing": True})
    closing = [e for e in timed[:-1] if "afd_timing" in e]
    assert len(closing) == 1 and closing[0]["choices"][0]["finish_reason"] == "length"
    assert closing[0]["afd_timing"]["index"] == 0 and closing[0]["afd_timing"]["engine_ttft_s"] > 0
    stamps = closing[0]["afd_timing"]["stamps"]  # the moments to the first token, in the order they happen
    order = ["arrived", "handler", "sent", "replica_took", "replica_stepped", "front_got", "written"]
    assert list(sorted(stamps, key=stamps.get)) == order, stamps
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    status, whole, _ = server.post("/v1/chat/completions", chat)
    assert status == 200 and whole["choices"][0]["message"]["role"] == "assistant"
    events = server.stream("/v1/chat/completions", chat)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == whole["choices"][0]["message"]["content"] and events[-1] == "[DONE]"


@pytest.mark.timeout(120)
def test_stop_strings_stop_tokens_echo_and_chat_logprobs(server):
    status, whole, _ = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 12, "temperature": 0})
    text = whole["choices"][0]["text"]
    stop = text[3:5]  # a stop string the greedy continuation is known to reach
    cut = text[: text.find(stop)]
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": [stop]}
    status, got, _ = server.post("/v1/completions", body)
    assert status == 200 and got["choices"][0]["text"] == cut and got["choices"][0]["finish_reason"] == "stop"
    events = server.stream("/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    # a stop token: the first greedy token ends the request and is not part of the text
    status, first, _ = server.post(
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 1, "temperature": 0, "return_tokens_as_token_ids": True, "logprobs": 0},
    )
    token = int(first["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
    status, got, _ = server.post(
        "/v1/completions", {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop_token_ids": [token]}
    )
    assert got["choices"][0] | {"logprobs": None} == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }
    assert got["usage"]["completion_tokens"] == 1
    status, echoed, _ = server.post(
        "/v1/completions", {"prompt": "abc", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    )
    lp = echoed["choices"][0]["logprobs"]
    assert echoed["choices"][0]["text"].startswith("abc") and lp["tokens"][:3] == ["a", "b", "c"]
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][:4] == [0, 1, 2, 3]
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    status, got, _ = server.post("/v1/chat/completions", chat)
    content = got["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == 3 and content[0]["top_logprobs"][0]["logprob"] == content[0]["logprob"]


@pytest.mark.timeout(120)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    cases = [
        ("/v1/completions", b"{oops", 400, None),
        ("/v1/completions", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 256]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "a", "n": 3}, 400, "n"),
        ("/v1/completions", {"prompt": "a", "top_k": -2}, 400, "top_k"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/nothing", {}, 404, None),
    ]
    for path, body, code, param in cases:
        status, got, _ = server.post(path, body)
        assert status == code, (path, body, got)
        assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["param"] == param
    status, models, _ = server.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096


@pytest.mark.timeout(120)
def test_an_api_key_guards_the_v1_routes():
    keyed = InProcessServer(num_replicas=1, api_key="sesame")
    try:
        status, got, headers = keyed.post("/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        assert got["error"]["type"] == "AuthenticationError"
        wrong = {"Authorization": "Bearer nope"}
        assert keyed.post("/v1/completions", {"prompt": "a", "max_tokens": 1}, headers=wrong)[0] == 401
        right = {"Authorization": "Bearer sesame"}
        assert keyed.post("/v1/completions", {"prompt": "a", "max_tokens": 1}, headers=right)[0] == 200
        assert keyed.request("GET", "/health")[0] == 200  # health and metrics need no key
        assert keyed.request("GET", "/metrics")[0] == 200
    finally:
        keyed.close()


@pytest.mark.timeout(120)
def test_a_replicas_captures_while_serving_reach_the_metrics(monkeypatch):
    """The count a replica's engine reports (CUDA graphs captured on a miss) travels with its load to the gauge."""
    from afd.engine.engine import Engine

    monkeypatch.setattr(Engine, "graphs_captured_while_serving", property(lambda self: 5))
    served = InProcessServer(num_replicas=1)
    try:
        assert served.post("/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200
        gauge = 'afd_graphs_captured_while_serving{replica="0"} 5.0'
        _wait(lambda: gauge in served.request("GET", "/metrics")[1], 30, "the count did not reach /metrics")
    finally:
        served.close()


def _open_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streaming request whose first chunk has arrived (so it is running on a replica)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return conn, resp


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_overload_gets_429_and_disconnects_abort_their_requests(server):
    """2 replicas of 2 running sequences each and --max-waiting 1: the 5th stream waits, the 6th request is
    refused; clients that leave mid-stream free their requests on the replicas."""
    streams = [_open_stream(server.port, 3000) for _ in range(4)]
    fifth = threading.Thread(target=lambda: streams.append(_open_stream(server.port, 3000)), daemon=True)
    fifth.start()
    _wait(lambda: server.state.pool.waiting() == 1, 30, "the fifth request did not wait")
    status, got, headers = server.post("/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert status == 429 and headers.get("Retry-After") == "1" and got["error"]["type"] == "RateLimitError"
    for conn, _ in streams[:4]:
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        conn.close()
    fifth.join(30)
    streams[4][0].close()
    _wait(lambda: not server.state.pool.requests, 30, "the front end did not drop the requests")
    _wait(lambda: not any(e.has_work() for e in server.engines), 30, "the replicas did not abort the requests")
    assert all(e.load().cache_usage == 0 for e in server.engines)  # every cache block is free again
    assert server.post("/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200
    status, page, _ = server.request("GET", "/metrics")
    assert status == 200 and 'afd_request_success_total{finished_reason="abort",replica="0"}' in page


@pytest.mark.timeout(120)
def test_a_lost_replica_ends_only_its_own_requests_and_health_says_degraded():
    """Replica 1's link breaks mid-stream: its stream ends with an error event and [DONE], replica 0's stream
    goes on to its end, /health answers 200 `degraded` with replica 1 not alive, and new requests go to replica 0;
    once replica 0 is gone too, /health is 503 `down` and a request is a 503 with Retry-After."""
    srv = InProcessServer(num_replicas=2)
    try:
        status, got, _ = srv.request("GET", "/health")
        assert status == 200 and got == {
            "status": "ok",
            "replicas": [{"index": 0, "alive": True, "restarts": 0}, {"index": 1, "alive": True, "restarts": 0}],
        }
        first, first_resp = _open_stream(srv.port, 3000)
        second, second_resp = _open_stream(srv.port, 3000)
        pool = srv.state.pool
        assert sorted(sub.replica for sub in pool.requests.values()) == [0, 1]  # the router spread them
        srv.cut(1)
        events = [e[len("data: ") :] for e in second_resp.read().decode().split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]" and "replica 1 closed its link" in json.loads(events[-2])["error"]["message"]
        lines = [first_resp.readline() for _ in range(40)]  # replica 0's stream goes on: 20 more events
        events = [line for line in lines if line.strip()]
        assert len(events) == 20 and all(e.startswith(b"data: {") and b'"error"' not in e for e in events)
        status, got, _ = srv.request("GET", "/health")
        assert status == 200 and got["status"] == "degraded" and got["replicas"][1]["alive"] is False
        status, got, _ = srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert status == 200, got
        first.close()
        second.close()
        cut = 1
        srv.cut(1 - cut)
        _wait(lambda: not any(pool.alive), 10, "the front end did not notice the second lost link")
        status, got, _ = srv.request("GET", "/health")
        assert status == 503 and got["status"] == "down"
        status, got, headers = srv.post("/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert status == 503 and headers.get("Retry-After") == "1" and got["error"]["code"] == 503
    finally:
        srv.close()


# ---------------------------------------------------------------- afd bench serve and the command line
def test_bench_serve_pieces():
    from afd.bench.report import slo_throughput
    from afd.bench.serve_client import percentile
    from afd.bench.workload import Workload
    from afd.cli.input import compare_list, rate_list

    assert compare_list("none:R=2,async:A=2,F=2") == [
        ("none R=2", ["--connector", "none", "--replicas", "2"]),
        ("async A=2,F=2", ["--connector", "async", "--attention", "2", "--ffn", "2"]),
    ]
    assert compare_list("async+sa:A=1,F=1") == [
        (
            "async+sa A=1,F=1",
            ["--connector", "async", "--shared-experts", "attention", "--attention", "1", "--ffn", "1"],
        )
    ]
    assert compare_list("async+sf")[0][1] == ["--connector", "async", "--shared-experts", "ffn"]
    assert compare_list("none:R=2,async:A=1,F=1,U=2") == [
        ("none R=2", ["--connector", "none", "--replicas", "2"]),
        ("async A=1,F=1,U=2", ["--connector", "async", "--attention", "1", "--ffn", "1", "--ubatches", "2"]),
    ]
    for bad in ("R=2", "none:A=2", "async:R=2", "p2p:A=0", "foo:R=1", "p2p+sa:A=1", "async+xx:A=1", "none:U=2"):
        with pytest.raises(Exception, match="--compare"):
            compare_list(bad)
    assert rate_list("1,2.5,inf") == [1.0, 2.5, float("inf")]
    with pytest.raises(Exception, match="positive request rates per second"):
        rate_list("0")
    w = Workload("uneven", requests=200, long_len=50, short_len=5, long_fraction=0.25)
    lengths = [len(p) for p in w.prompts(256)]
    assert set(lengths) == {5, 50} and 30 < lengths.count(50) < 70 and w.prompts(256) == w.prompts(256)
    arrivals = w.arrivals(10.0)
    assert arrivals == sorted(arrivals) and 10 < arrivals[-1] < 30  # ~200 requests at 10/s
    assert max(len(p) for p in Workload("mixed", 200, 64, 8).prompts(256)) <= 64
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([3], 99) == 3
    runs = [{"rate": r, "summary": {"errors": 0, "ttft_p90_s": t}} for r, t in ((1, 0.5), (2, 4.0), (4, 9.0))]
    assert slo_throughput(runs, 5.0) == 2 and slo_throughput(runs, 0.1) is None


@pytest.mark.timeout(120)
def test_bench_url_measures_a_running_server(server):
    from afd.bench.report import format_table
    from afd.bench.serve_client import bench_url
    from afd.bench.workload import Workload

    workload = Workload("uneven", requests=4, long_len=40, short_len=4, long_fraction=0.5, max_tokens=4)
    runs = bench_url(f"http://127.0.0.1:{server.port}", workload, [float("inf")], vocab_size=256)
    s = runs[0]["summary"]
    assert (s["completed"], s["errors"], s["output_tokens"]) == (4, 0, 16) and s["ttft_p50_s"] > 0
    assert all(len(r["itl_s"]) == 3 for r in runs[0]["requests"])
    assert all(0 < r["engine_ttft_s"] < r["ttft_s"] for r in runs[0]["requests"])
    assert 0 < s["front_end_p50_s"] < s["ttft_p50_s"]
    status, page, _ = server.request("GET", "/metrics")
    assert status == 200 and 'afd_engine_time_to_first_token_seconds_count{replica="0"}' in page
    assert "SLO-compliant throughput" in format_table([{"name": "x", "runs": runs}], 5.0)


def test_cli_refuses_bad_serve_input_before_starting_anything(capsys):
    from afd.cli import main as cli

    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = str(taken.getsockname()[1])
        assert cli.main(["serve", "--model", MODEL, "--port", port]) == 2
        assert (
            capsys.readouterr().err.strip()
            == f"afd: error: port {port} on 127.0.0.1 is already in use; pick another --port"
        )
    finally:
        taken.close()
    for argv, words in (
        (["serve", "--model", MODEL, "--attention", "2"], "--attention, --ffn"),
        (["serve", "--model", MODEL, "--ubatches", "2"], "--ubatches need --connector p2p or async"),
        (["serve", "--model", MODEL, "--connector", "async", "--attention", "2", "--replicas", "3"], "--replicas"),
        (["serve", "--model", "no-such-model"], "neither a preset"),
        (["serve", "--model", MODEL, "--shared-experts", "attention"], "--shared-experts attention needs --connector"),
        (["serve", "--model", MODEL, "--max-model-len", "99999"], "--max-model-len"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("afd: error: ") and words in err and "Traceback" not in err
    for argv in (["bench", "serve", "--compare", "none:X=1"], ["serve", "--model", MODEL, "--ubatches", "0"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2


@pytest.mark.timeout(120)
def test_the_official_openai_client(server, reference):
    """The `openai` package against the server: completions and chat, whole and streamed, 32 concurrent
    streams, and its error classes for our status codes."""
    openai = pytest.importorskip("openai")
    base = f"http://127.0.0.1:{server.port}/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    prompts, outputs = reference
    got = client.completions.create(
        model=MODEL,
        prompt=prompts[0],
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert [int(t.split(":")[1]) for t in got.choices[0].logprobs.tokens] == outputs[0].token_ids
    assert got.usage.completion_tokens == 6 and got.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=0, stream=True)
    whole = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="a")

    async def many() -> list[str | None]:
        aclient = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)

        async def one(i: int) -> str | None:
            stream = await aclient.completions.create(model=MODEL, prompt=[i + 1, 2], max_tokens=4, stream=True)
            return [c.choices[0].finish_reason async for c in stream][-1]

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    server.state.options.max_waiting = 1000  # this module's server refuses a second waiting request otherwise
    try:
        assert asyncio.run(many()) == ["length"] * 32
    finally:
        server.state.options.max_waiting = 1


def test_a_request_whose_replica_answers_nothing_ends_with_504(monkeypatch):
    """A replica alive but silent (frozen): the request's wait is bounded, it ends with one sentence and is aborted
    on its replica."""
    import asyncio
    from types import SimpleNamespace

    from afd.engine.sampling import SamplingParams
    from afd.serve import output
    from afd.serve.protocol import APIError, GenerationParams
    from afd.serve.tokenizer import ByteTokenizer

    aborted = []
    pool = SimpleNamespace(
        submit=lambda *args, **kwargs: SimpleNamespace(queue=asyncio.Queue(), replica=1),
        abort=lambda rid, *reason: aborted.append(rid),
    )
    monkeypatch.setattr(output, "REQUEST_STALL_S", 0.2)
    params = GenerationParams(max_tokens=4, sampling=SamplingParams())

    async def pull() -> None:
        run = output.run_request(pool, ByteTokenizer(256), "r1", output.Prepared([1, 2], 4), params)
        async for _ in run.pieces():
            pass

    with pytest.raises(APIError) as err:
        asyncio.run(pull())
    assert err.value.status == 504 and "replica 1 sent nothing for this request in 0.2 s" in err.value.message
    assert aborted == ["r1"]


def test_a_call_submits_all_its_prompts_or_none():
    """`Call.start` (run before a stream's headers go out) submits every prompt at once; when one cannot be
    submitted (no replica alive), the prompts already submitted are aborted and the error is the 503."""
    from types import SimpleNamespace

    from afd.engine.sampling import SamplingParams
    from afd.serve.output import Prepared
    from afd.serve.protocol import APIError, GenerationParams
    from afd.serve.responses import Call
    from afd.serve.tokenizer import ByteTokenizer

    submitted, aborted = [], []

    def submit(rid, *args, **kwargs):
        if len(submitted) == 2:
            raise LookupError("no replica is alive")
        submitted.append(rid)
        return SimpleNamespace(queue=None, replica=0)

    pool = SimpleNamespace(submit=submit, abort=lambda rid, *reason: aborted.append(rid))
    state = SimpleNamespace(pool=pool, tokenizer=ByteTokenizer(256))
    params = GenerationParams(max_tokens=4, sampling=SamplingParams())
    two = Call(state, "cmpl-a", [Prepared([1], 4), Prepared([2], 4)], params, None)
    two.start()
    two.start()  # at most once
    assert submitted == ["cmpl-a-0", "cmpl-a-1"] and aborted == []
    three = Call(state, "cmpl-b", [Prepared([1], 4)] * 3, params, None)
    submitted.clear()
    submitted += ["x", "y"]  # the pool takes no more after two
    with pytest.raises(APIError) as err:
        three.start()
    assert err.value.status == 503 and aborted == [] and three.runs is None
    submitted.clear()
    submitted.append("x")
    with pytest.raises(APIError):
        three.start()
    assert aborted == ["cmpl-b-0"]  # the one it submitted, aborted


def test_events_waiting_for_a_stream_come_out_in_one_batch_and_a_failure_after_them():
    """A front end behind its replicas finds several steps' events queued for a stream: `Run.batches` hands them
    out together (one write), in order; a failure queued behind tokens comes after their pieces, not instead."""
    from types import SimpleNamespace

    from afd.engine.sampling import SamplingParams
    from afd.serve import output
    from afd.serve.frontend import Event
    from afd.serve.protocol import APIError, GenerationParams
    from afd.serve.tokenizer import ByteTokenizer

    queue: asyncio.Queue = asyncio.Queue()
    pool = SimpleNamespace(
        submit=lambda *args, **kwargs: SimpleNamespace(queue=queue, replica=0, stamps={}, engine_ttft_s=None),
        abort=lambda rid, *reason: None,
    )
    params = GenerationParams(max_tokens=8, sampling=SamplingParams())

    async def batches(events: list[Event]) -> list[list]:
        for event in events:
            queue.put_nowait(event)
        run = output.run_request(pool, ByteTokenizer(256), "r1", output.Prepared([1, 2], 8), params)
        got = []
        async for batch in run.batches():
            got.append([(p.token_id, p.finish_reason) for p in batch])
        return got

    steps = [Event("tokens", items=[(65 + i, -0.5)]) for i in range(3)]
    ended = Event("finished", reason="length")
    assert asyncio.run(batches([*steps, ended])) == [[(65, None), (66, None), (67, None), (None, "length")]]
    failed = Event("finished", reason="error", message="rank died", status=503)
    seen: list = []

    async def until_failure() -> None:
        for event in [*steps, failed]:
            queue.put_nowait(event)
        run = output.run_request(pool, ByteTokenizer(256), "r2", output.Prepared([1, 2], 8), params)
        async for batch in run.batches():
            seen.append([p.token_id for p in batch])

    with pytest.raises(APIError, match="rank died"):
        asyncio.run(until_failure())
    assert seen == [[65, 66, 67]]
