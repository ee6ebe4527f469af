"""The steps' device time beside a served run's wall time: the replica's load message -> the front end's gauges ->
`/metrics` -> `afd bench serve`'s reading of it (`step_clock_of`) -> its report line. (The CUDA events themselves:
tests/e2e/test_engine_overlap_gpu.py.)"""

from __future__ import annotations

import torch

from afd.bench.report import format_table
from afd.bench.serve_client import step_clock_of
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.request import EngineLoad
from afd.model.weights import load_attention_model, load_ffn_model
from afd.serve.metrics import ServeMetrics


def _page(values: list[tuple[float, ...]]) -> str:
    metrics = ServeMetrics(len(values))
    for replica, (seconds, steps, idle, *prompt) in zip(metrics.replicas, values, strict=True):
        replica.step_device.set(seconds)
        replica.steps.set(steps)
        replica.step_idle.set(idle)
        if prompt:
            replica.prompt_step_device.set(prompt[0])
            replica.prompt_steps.set(prompt[1])
    return metrics.render(healthy=True, front_waiting=0).decode()


def test_metrics_page_sums_the_replicas_step_device_time() -> None:
    assert step_clock_of(_page([(1.5, 100, 0.25), (0.5, 40, 0.5)])) == (2.0, 140, 2, 0.75, 0.0, 0)
    assert step_clock_of(_page([(1.5, 100, 0.0), (0.0, 0, 0.0)])) == (1.5, 100, 1, 0.0, 0.0, 0)
    # the part of them that held a prompt token, every replica's together
    assert step_clock_of(_page([(1.5, 100, 0.25, 0.5, 10), (0.5, 40, 0.5, 0.25, 4)])) == (2.0, 140, 2, 0.75, 0.75, 14)
    assert step_clock_of(_page([(0.0, 0, 0.0)])) is None  # CPU: no step is timed
    assert step_clock_of("# a server without afd's series\nup 1\n") is None


def test_report_sets_the_steps_beside_the_wall_time() -> None:
    summary = {"completed": 4, "errors": 0, "request_throughput": 2.0, "output_tok_s": 10.0, "wall_s": 6.0}
    summary |= {f"{n}_p{q}_s": 0.01 for n in ("ttft", "tpot", "e2e") for q in (50, 90, 99)}
    steps = {"device_s": 8.0, "count": 300, "replicas": 2, "idle_s": 1.0}
    timed = {"rate": float("inf"), "summary": summary | {"steps": steps}}
    untimed = {"rate": 1.0, "summary": summary}
    table = format_table([{"name": "none R=2", "runs": [timed, untimed]}], slo_ttft_s=1.0)
    lines = [line for line in table.splitlines() if "wall/steps" in line]
    assert lines == [
        "none R=2 at inf: wall 6.00 s, its 300 steps 4.00 s of device time per replica: wall/steps 1.50x; the device "
        "idled 0.50 s between steps"
    ]


def test_a_cpu_engine_times_no_step_and_a_load_change_ignores_the_clock() -> None:
    engine = Engine(load_attention_model("tiny"), LocalExchange(load_ffn_model("tiny")), 64, max_num_seqs=4)
    engine.add(Request(torch.arange(1, 6).tolist(), 3))
    engine.run()
    load = engine.load()
    assert (load.step_device_s, load.steps) == (0.0, 0)
    # sent on a load change only: the clock's figures do not make one
    assert EngineLoad(0, 0, 0.0, 0, 1.0, 5, 0.1, 0.5, 2) == EngineLoad(0, 0, 0.0, 0, 2.0, 9, 0.2, 1.0, 3)


def test_host_time_is_counted_per_launched_step_and_apart_for_steps_with_prompt_tokens() -> None:
    engine = Engine(load_attention_model("tiny"), LocalExchange(load_ffn_model("tiny")), 8, max_num_seqs=4)
    kinds: list[bool] = []  # per launch: whether the step held a prompt token
    launch = engine.runner.launch

    def counting(scheduled, *args, **kwargs):
        kinds.append(not all(s.is_decode for s in scheduled))
        return launch(scheduled, *args, **kwargs)

    engine.runner.launch = counting
    for i in range(3):
        engine.add(Request(torch.arange(1, 4 + 6 * i).tolist(), 4))  # 3..15-token prompts over an 8-token budget
    engine.run()
    clock = engine.runner.step_clock
    assert clock.host_steps == len(kinds) and clock.prompt_host_steps == sum(kinds)
    assert 0 < sum(kinds) < len(kinds)  # prefill/mixed steps and pure decode steps both ran
    assert 0 < clock.prompt_host_seconds < clock.host_seconds
    assert clock.steps == 0  # no device time on CPU
