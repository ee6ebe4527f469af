"""`afd bench serve`: its workloads and trace parser, the SLO computation, the progress and the plot, one smoke run
of `--overhead` (HTTP vs the engine alone) on the tiny model as a user runs it, and the run harness's place
below the commands and above the role runtimes."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest

from afd.bench.report import format_table, slo_summary, slo_throughput
from afd.bench.serve_client import (
    TTFT_STAGES,
    Progress,
    RequestResult,
    is_this_host,
    percentile,
    run_rates,
    summarize,
    ttft_stages,
)
from afd.bench.workload import TraceEntry, TraceError, Workload, load_trace
from afd.engine.engine import Request, StepToken


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------- trace
def test_trace_parser_reads_entries_and_refuses_bad_lines_in_one_sentence(tmp_path: Path) -> None:
    good = write(tmp_path / "t.jsonl", '{"prompt_len": 3, "max_tokens": 2}\n\n  \n{"max_tokens": 5, "prompt_len": 9}\n')
    assert load_trace(good) == (TraceEntry(3, 2), TraceEntry(9, 5))
    timed = write(tmp_path / "timed.jsonl", '{"prompt_len": 3, "max_tokens": 2, "arrival_s": 0.5}\n' * 2)
    assert load_trace(timed) == (TraceEntry(3, 2, 0.5),) * 2
    cases = {
        '{"prompt_len": 3}': "line 1 must be an object with prompt_len, max_tokens",
        '{"prompt_len": 3, "max_tokens": 2, "n": 1}': "line 1 must be an object",
        "[1, 2]": "line 1 must be an object",
        '{"prompt_len": 0, "max_tokens": 2}': "line 1: prompt_len must be a positive integer, got 0",
        '{"prompt_len": true, "max_tokens": 2}': "prompt_len must be a positive integer, got True",
        '{"prompt_len": 2, "max_tokens": 2.5}': "max_tokens must be a positive integer, got 2.5",
        '{"prompt_len": 2, "max_tokens": 2, "arrival_s": -1}': "arrival_s must be a non-negative number",
        '{"prompt_len": 2, "max_tokens": 2, "arrival_s": "1"}': "arrival_s must be a non-negative number",
        '{"prompt_len": 2, "max_tokens": 2}\n{"prompt_len": 2': "line 2 is not JSON",
        '{"prompt_len": 2, "max_tokens": 2}\n{"prompt_len": 2, "max_tokens": 2, "arrival_s": 1}': "either every line",
        "\n\n": "has no requests",
    }
    for i, (text, words) in enumerate(cases.items()):
        with pytest.raises(TraceError, match="trace ") as info:
            load_trace(write(tmp_path / f"bad{i}.jsonl", text + "\n"))
        assert words in str(info.value) and "\n" not in str(info.value), text
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------- workloads
@pytest.mark.parametrize("kind", ["uniform", "uneven", "mixed", "trace"])
def test_workloads_are_seeded_and_the_same_at_every_rate(kind: str) -> None:
    trace = tuple(TraceEntry(n, 1 + n % 3) for n in (5, 40, 7, 12) * 10)
    w = Workload(kind, 40, long_len=64, short_len=8, seed=3, trace=trace if kind == "trace" else ())
    prompts = w.prompts(256)
    assert len(prompts) == w.num_requests == 40 and prompts == w.prompts(256)  # seeded
    assert Workload(**{**vars(w), "seed": 4}).prompts(256) != prompts
    assert all(0 <= t < 256 for p in prompts for t in p)
    shortest = {"mixed": 1, "trace": 4}.get(kind, 8)  # mixed: lognormal with median 8, so some are shorter
    assert all(shortest <= len(p) <= 64 for p in prompts)
    one, two = w.arrivals(1.0), w.arrivals(2.0)
    assert one == sorted(one) and one[0] == 0.0 and one == w.arrivals(1.0)
    assert all(math.isclose(a, 2 * b) for a, b in zip(one, two, strict=True))  # the same draws, scaled by the rate
    assert w.arrivals(math.inf) == [0.0] * 40
    if kind == "trace":
        assert [len(p) for p in prompts] == [e.prompt_len for e in trace]
        assert w.max_tokens_of() == [e.max_tokens for e in trace]
    else:
        assert w.max_tokens_of() == [64] * 40
    if kind == "uniform":
        lengths = [len(p) for p in prompts]
        assert len(set(lengths)) > 10  # spread over the range, not two values
        assert {len(p) for p in Workload("uniform", 20, long_len=16, short_len=16).prompts(256)} == {16}


def test_a_timed_trace_is_one_run_at_its_own_pace() -> None:
    trace = (TraceEntry(4, 2, 0.0), TraceEntry(4, 2, 1.5), TraceEntry(4, 2, 3.0))
    w = Workload("trace", seed=0, trace=trace)
    assert w.timed and w.arrivals(100.0) == [0.0, 1.5, 3.0] and w.mean_rate() == pytest.approx(2 / 3)
    assert run_rates(w, [1.0, 2.0]) == [pytest.approx(2 / 3)]
    assert not Workload("trace", trace=(TraceEntry(4, 2),)).timed and run_rates(Workload(), [1.0, 2.0]) == [1.0, 2.0]
    assert w.describe() == {"kind": "trace", "requests": 3, "timed": True, "seed": 0, "warmups": 0}


def test_the_warm_up_is_the_workloads_first_requests() -> None:
    w = Workload("mixed", requests=6, long_len=300, short_len=20, max_tokens=5, seed=3, warmups=4)
    warm = w.warm_up_requests(vocab_size=500)
    assert [p for p, _ in warm] == w.prompts(500)[:4] and [n for _, n in warm] == [5] * 4
    assert len(Workload(requests=3, warmups=8).warm_up_requests(100)) == 3  # never more than the workload has
    assert Workload(requests=3).warm_up_requests(100) == [] and w.describe()["warmups"] == 4


# ---------------------------------------------------------------- summary and SLO
def test_summary_has_tpot_and_request_throughput() -> None:
    results = [
        RequestResult(4, output_tokens=5, ttft_s=0.1, itl_s=[0.1] * 4, e2e_s=0.5),  # TPOT (0.5 - 0.1) / 4
        RequestResult.from_token_times(4, [0.2, 0.5]),  # TPOT 0.3
        RequestResult.from_token_times(4, [0.3]),  # one token: no TPOT
        RequestResult(4, error="HTTP 500: boom"),
    ]
    assert results[1] == RequestResult(4, 2, 0.2, [0.3], 0.5) and results[2].tpot_s is None
    s = summarize(results, wall_s=2.0)
    assert (s["requests"], s["completed"], s["errors"], s["output_tokens"]) == (4, 3, 1, 8)
    assert s["request_throughput"] == 1.5 and s["output_tok_s"] == 4.0 and s["first_error"] == "HTTP 500: boom"
    assert s["tpot_p50_s"] == pytest.approx(0.2) and s["tpot_p99_s"] == pytest.approx(0.298)
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["e2e_p90_s"] == pytest.approx(0.5)
    assert percentile([], 50) is None


def _run(rate: float, ttft_p90: float | None, errors: int = 0, served: float = 1.0) -> dict:
    summary = {"errors": errors, "ttft_p90_s": ttft_p90, "request_throughput": served, "output_tok_s": 10 * served}
    return {"rate": rate, "summary": summary}


def test_ttft_is_cut_at_the_servers_stamps_and_the_stages_sum_to_it() -> None:
    stamps = {"arrived": 10.25, "handler": 10.5, "sent": 10.75, "replica_took": 11.0, "replica_stepped": 14.0,
              "front_got": 14.25, "written": 14.5}  # fmt: skip
    stages = ttft_stages(10.0, 15.0, stamps)
    assert stages == {"client_to_arrived": 0.25, "arrived_to_handler": 0.25, "handler_to_sent": 0.25,
                      "sent_to_replica": 0.25, "engine": 3.0, "replica_to_front": 0.25, "front_to_written": 0.25,
                      "written_to_client": 0.5}  # fmt: skip
    assert list(stages) == [name for name, _ in TTFT_STAGES] and sum(stages.values()) == 5.0
    assert ttft_stages(10.0, 15.0, {k: v for k, v in stamps.items() if k != "front_got"}) is None
    # the summary has each stage's p50 over the requests that carry stages, none when no request does
    results = [RequestResult(8, 2, 5.0, [0.1], 5.1, stages_s=stages), RequestResult(8, 2, 5.0, [0.1], 5.1)]
    assert summarize(results, 10.0)["ttft_stages_p50_s"] == stages
    assert "ttft_stages_p50_s" not in summarize(results[1:], 10.0)
    assert is_this_host("http://127.0.0.1:8000") and is_this_host("http://localhost:1")
    assert not is_this_host("http://10.0.0.7:8000")


def test_slo_compliant_throughput_is_the_highest_rate_within_the_ttft_slo_without_errors() -> None:
    runs = [_run(1, 0.5), _run(2, 4.0, served=1.9), _run(4, 9.0), _run(8, 1.0, errors=1), _run(16, None, errors=64)]
    assert slo_throughput(runs, 5.0) == 2 and slo_throughput(runs, 0.1) is None and slo_throughput(runs, 4.0) == 2
    assert slo_throughput(runs, 10.0) == 4  # 8/s met the TTFT bound but failed a request
    assert slo_summary(runs, 5.0) == {"slo_ttft_s": 5.0, "rate": 2, "request_throughput": 1.9, "output_tok_s": 19.0}
    assert slo_summary(runs, 0.1)["rate"] is None
    assert slo_throughput([_run(math.inf, 1.0), _run(4, 1.0)], 5.0) == math.inf
    full = {k: 0.0 for k in ("request_throughput", "output_tok_s", "completed", "errors")}
    full |= {f"{n}_p{q}_s": 0.25 for n in ("ttft", "tpot", "itl", "e2e") for q in (50, 90, 99)}
    table = format_table([{"name": "async A=2,F=2", "runs": [{"rate": 3.0, "summary": full}]}], 5.0)
    assert "TPOT p50" in table and "250ms" in table
    assert "async A=2,F=2: SLO-compliant throughput (p90 TTFT <= 5 s): 3/s" in table
    assert "note:" not in table  # no capacity run
    short = format_table([{"name": "p2p", "runs": [{"rate": math.inf, "summary": full | {"wall_s": 1.3}}]}], 5.0)
    assert short.splitlines()[-1].startswith("note: the shortest run at rate inf lasted 1.3 s")
    long = format_table([{"name": "p2p", "runs": [{"rate": math.inf, "summary": full | {"wall_s": 6.5}}]}], 5.0)
    assert "note:" not in long


# ---------------------------------------------------------------- the engine alone
class FakeEngine:
    """One token per step for every live request; records when each request was added."""

    def __init__(self, clock) -> None:
        self.clock, self.live, self.added_at, self.next_id = clock, {}, {}, 0
        self.last_step_tokens: list[StepToken] = []

    def add(self, request: Request) -> int:
        self.added_at[self.next_id] = self.clock()
        self.live[self.next_id] = request.max_new_tokens
        self.next_id += 1
        return self.next_id - 1

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> list[int]:
        self.last_step_tokens = [StepToken(i, 7, 0.0) for i in self.live]
        done = [i for i in self.live if self.live[i] == 1]
        self.live = {i: n - 1 for i, n in self.live.items() if n > 1}
        return done


def test_drive_arrivals_adds_each_request_at_its_arrival_and_times_tokens_from_it() -> None:
    import time

    from afd.bench.harness import drive_arrivals

    start = time.perf_counter()
    engine = FakeEngine(lambda: time.perf_counter() - start)
    finished = []
    arrivals = [0.0, 0.15, 0.05]
    times = drive_arrivals(engine, [Request([1], n) for n in (2, 3, 1)], arrivals, 10.0, lambda: finished.append(1))
    assert [len(t) for t in times] == [2, 3, 1] and len(finished) == 3
    order = sorted(range(3), key=arrivals.__getitem__)  # engine ids are given in arrival order
    for engine_id, i in enumerate(order):
        assert engine.added_at[engine_id] >= arrivals[i]  # never before its arrival
    assert all(t == sorted(t) and t[0] >= 0 for t in times)
    with pytest.raises(TimeoutError, match="within 0.05 s"):
        drive_arrivals(FakeEngine(time.perf_counter), [Request([1], 1)], [5.0], 0.05)


# ---------------------------------------------------------------- progress and plot
class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_tqdms_bar_on_a_terminal_and_milestone_lines_in_a_log() -> None:
    log = io.StringIO()
    p = Progress(log)
    p.note("none R=1: starting the server ...")
    p.start("none R=1: rate 4/s", 3)
    for _ in range(3):
        p.advance()
    p.finish()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("[afd bench serve] none R=1: rate 4/s: 3/3 requests in ")
    assert "\r" not in log.getvalue()
    tty = Tty()
    p = Progress(tty)
    p.start("x", 2)
    p.advance()
    p.finish()
    assert "x: 100%" not in tty.getvalue() and "x:  50%" in tty.getvalue() and "1/2" in tty.getvalue()
    silent = Progress()  # the library's default: nothing written anywhere
    silent.note("n")
    silent.start("x", 1)
    silent.advance()
    silent.finish()


def test_plot_draws_latency_against_rate_per_server(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from afd.bench.report import plot_results

    def run(rate: float, scale: float) -> dict:
        summary = {f"{n}_p{q}_s": scale * q / 50 for n in ("ttft", "tpot", "e2e") for q in (50, 90, 99)}
        return {"rate": rate, "summary": summary | {"tpot_p90_s": None}}

    results = [
        {"name": "p2p A=2,F=2", "runs": [run(4.0, 2.0), run(1.0, 0.5), run(math.inf, 9.0)]},
        {"name": "async A=2,F=2", "runs": [run(1.0, 0.4), run(4.0, 1.0)]},
    ]
    path = tmp_path / "latency.png"
    plot_results(results, path, slo_ttft_s=5.0, title="tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# ---------------------------------------------------------------- the command line
def test_bench_serve_refuses_bad_workload_flags_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from afd.cli import main as cli

    timed = write(tmp_path / "timed.jsonl", '{"prompt_len": 4, "max_tokens": 2, "arrival_s": 0}\n')
    long = write(tmp_path / "long.jsonl", '{"prompt_len": 4, "max_tokens": 2}\n{"prompt_len": 500, "max_tokens": 20}\n')
    bad = write(tmp_path / "bad.jsonl", '{"prompt_len": 4}\n')
    cases = [
        (["--trace", str(bad)], "line 1 must be an object"),
        (["--trace", str(timed), "--workload", "mixed"], "pass --workload or --trace, not both"),
        (["--trace", str(timed), "--rates", "2"], "has its own arrival times (arrival_s); leave --rates out"),
        (["--trace", str(long), "--max-model-len", "512"], "request 2 takes 500 + 20 positions, more than the 512"),
        (["--long-len", "4090", "--max-tokens", "64"], "is more than the 4096 positions a request may take"),
    ]
    cases.append((["--json", str(tmp_path / "no" / "x.json")], "--json " + str(tmp_path / "no" / "x.json")))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    cases.append(
        (["--plot", str(tmp_path / "x.png")], "--plot needs matplotlib; install it with pip install 'afd[bench]'")
    )
    for argv, words in cases:
        assert cli.main(["bench", "serve", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("afd: error: ") and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(SystemExit) as exit_info:  # argparse's own refusal: one line, status 2
        cli.main(["bench", "serve", "--warmups", "-1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--warmups: expected a non-negative integer" in err, err
    for flag in ("--rates", "--rate"):  # --rate: the flag's first name, kept as an alias
        assert cli.build_parser().parse_args(["bench", "serve", flag, "1,inf"]).rates == [1.0, math.inf]
