"""`afd bench serve`: its workloads and trace parser, the SLO computation, the progress and the plot, one smoke run
of `--overhead` (HTTP vs the engine alone) on the tiny model as a user runs it, and the run harness's place
below the commands and above the role runtimes."""

from __future__ import annotations

import ast
import io
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import e2e
from helpers.e2e import Leftovers

from afd.bench.progress import BarProgress, LineProgress, stderr_progress
from afd.bench.report import format_table, slo_summary, slo_throughput
from afd.bench.serve_client import (
    TTFT_STAGES,
    RequestResult,
    is_this_host,
    percentile,
    run_rates,
    summarize,
    ttft_stages,
)
from afd.bench.workload import TraceEntry, TraceError, Workload, load_trace
from afd.engine.engine import Request, StepToken

SRC = Path(__file__).resolve().parents[1] / "src"


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


def test_progress_is_a_bar_on_a_terminal_and_milestone_lines_in_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()
    p = stderr_progress(stream=log)
    assert isinstance(p, LineProgress)
    p.note("none R=1: starting the server ...")
    p.start("none R=1: rate 4/s", 3)
    for _ in range(3):
        p.advance()
    p.finish()
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("[afd bench serve] none R=1: rate 4/s: 3/3 requests in ")
    assert "\r" not in log.getvalue()
    pytest.importorskip("tqdm")
    assert isinstance(stderr_progress(stream=Tty()), BarProgress)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: a line rewritten in place
    tty = Tty()
    p = stderr_progress(stream=tty)
    assert isinstance(p, LineProgress) and p.in_place
    p.start("x", 2)
    p.advance()
    assert tty.getvalue().endswith("\r[afd bench serve] x: 1/2 requests\033[K")


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
    cases.append((["--plot", str(tmp_path / "x.png")], "--plot needs matplotlib; install it with pip install"))
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


def _kill_tagged_servers() -> None:
    """`afd serve` front ends of this test still alive (a bench killed by the timeout leaves its server)."""
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        cmdline = e2e._cmdline(pid) if pid else []
        if cmdline[1:4] == [b"-m", b"afd", b"serve"] and e2e._tagged(pid, e2e.test_tag()):
            try:
                os.killpg(pid, signal.SIGKILL)  # a ServerProcess is its own session
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.timeout(150)
def test_bench_serve_overhead_smoke_on_tiny(tmp_path: Path) -> None:
    """HTTP vs the engine alone in one run, from a trace, with the raw JSON (and the plot where matplotlib is):
    no timing assertions, only that every number is there and nothing is left behind."""
    trace = write(tmp_path / "trace.jsonl", "".join(f'{{"prompt_len": {n}, "max_tokens": 3}}\n' for n in (9, 30, 4)))
    out, png = tmp_path / "out.json", tmp_path / "plot.png"
    plot = ["--plot", str(png)] if _has("matplotlib") else []
    small = ["--max-num-seqs", "8", "--max-model-len", "256", "--max-num-batched-tokens", "256"]
    argv = ["bench", "serve", "--overhead", "--trace", str(trace), "--rates", "4", *small, "--json", str(out), *plot]
    leftovers = Leftovers()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "afd", *argv], capture_output=True, text=True, timeout=130, env=_env()
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "engine alone: rate 4/s: 3/3 requests" in proc.stderr  # progress lines (stderr is no terminal)
        assert "front end over the engine alone" in proc.stdout and "the front end adds" in proc.stdout
        raw = json.loads(out.read_text())
        assert [r["name"] for r in raw["results"]] == ["none R=1", "engine alone"]
        assert raw["workload"]["kind"] == "trace" and raw["workload"]["trace_file"] == str(trace)
        assert raw["workload"]["warmups"] == 8  # the default: here all three requests, once untimed
        for res in raw["results"]:
            s = res["runs"][0]["summary"]
            assert (s["completed"], s["errors"], s["output_tokens"]) == (3, 0, 9) and s["tpot_p50_s"] is not None
            assert res["slo"]["slo_ttft_s"] == 5.0
        (row,) = raw["front_end_overhead"]
        assert row["rate"] == 4.0 and row["requests"] == 3 and None not in row.values()
        # the server reported each request's engine share, and it is a part of what the client measured
        served = raw["results"][0]["runs"][0]["requests"]
        assert all(0 < r["engine_ttft_s"] < r["ttft_s"] for r in served), served
        assert 0 < row["front_end_p50_s"] <= row["front_end_p90_s"] and row["http_floor_p50_s"] > 0
        # on one host the client's TTFT is cut at the server's stamps: every stage took time, and they sum to it
        for r in served:
            assert all(s > 0 for s in r["stages_s"].values()), r["stages_s"]
            assert math.isclose(sum(r["stages_s"].values()), r["ttft_s"], rel_tol=1e-6)
            assert math.isclose(r["stages_s"]["engine"], r["engine_ttft_s"], rel_tol=1e-6, abs_tol=1e-6)
        assert set(row["ttft_stages_p50_s"]) == {name for name, _ in TTFT_STAGES}
        assert "the server's TTFT by stage" in proc.stdout
        assert not plot or png.read_bytes()[:4] == b"\x89PNG"
        leftovers.check()
    finally:
        _kill_tagged_servers()
        leftovers.cleanup()


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


# ---------------------------------------------------------------- structure
RUNTIME = ("rank", "online", "worker", "async_rank", "harness")


def _runtime_imports(name: str) -> set[str]:
    """The `afd.runtime` modules `name` imports, at the top or inside a function."""
    tree = ast.parse((SRC / "afd" / "runtime" / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("afd.runtime."):
            found.add(node.module.removeprefix("afd.runtime."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("afd.runtime.") for a in node.names if a.name.startswith("afd.runtime.")}
    return found & set(RUNTIME)


def test_the_runtimes_depend_one_way_and_import_alone() -> None:
    """worker and async_rank imported each other (issue 12 item 7); the harness lived in demo.py."""
    graph = {name: _runtime_imports(name) for name in RUNTIME}
    assert graph["rank"] == set() and "harness" not in set().union(*(graph[n] for n in RUNTIME if n != "harness"))

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    assert not [n for n in RUNTIME if reaches(n, n)], f"an import cycle among the runtimes: {graph}"
    for name in ("afd.bench.demo", "afd.bench.offline", "afd.bench.overhead"):
        assert "afd.bench.harness" in (SRC / Path(*name.split("."))).with_suffix(".py").read_text()
    # each module imported first, in a fresh interpreter's module table (torch loaded once to keep it fast)
    script = (
        "import importlib, sys, torch\n"
        f"for name in {[f'afd.runtime.{n}' for n in RUNTIME]}:\n"
        "    for m in [m for m in sys.modules if m == 'afd' or m.startswith('afd.')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
