"""The front end's FIFO queue in the simulator: its arithmetic as a pure function, the arrivals it hands the
engines, its effect on a simulated trace, and older profiles without it (the calibration finding it:
tests/e2e/test_planning_calibration_search.py)."""

from __future__ import annotations

import json
import math

import pytest
from helpers.planning import cpu_profile, tiny_shapes

from afd.bench.workload import Workload
from afd.planning.deployment import Deployment
from afd.planning.profile import Calibration, front_end_queue, load_profile
from afd.planning.simulator import engine_arrivals, simulate_rate


def test_queue_serves_one_request_at_a_time():
    c = 0.25
    assert front_end_queue([0.0, 0.0, 0.0], c) == pytest.approx([c, 2 * c, 3 * c])
    # an idle front end takes a request at once; a busy one when it is done with the one before
    assert front_end_queue([0.0, 10.0, 10.1, 10.2], 1.0) == pytest.approx([1.0, 11.0, 12.0, 13.0])
    assert front_end_queue([1.0, 2.0, 5.0], 0.0) == [1.0, 2.0, 5.0]
    assert front_end_queue([], 1.0) == []


def test_engine_arrivals_follow_send_order_and_add_the_latency():
    p = cpu_profile(Calibration(arrival_s=0.1, front_end_s=0.01), front_end_s=0.002)
    # requests 0 and 2 sent together, request 1 first: served 1, 0, 2
    got = engine_arrivals([1.0, 0.5, 1.0], p)
    assert got == pytest.approx([1.1 + 0.012, 0.6 + 0.012, 1.2 + 0.012])
    # ep's simulated replicas standing for 4 times as many: each simulated request carries 4 requests' cost
    assert engine_arrivals([0.0, 0.0], cpu_profile(Calibration(arrival_s=0.1)), 4.0) == pytest.approx([0.4, 0.8])


def _workload(requests: int = 40) -> Workload:
    return Workload("mixed", requests, long_len=128, short_len=16, max_tokens=8, seed=3)


def test_queue_delays_first_tokens_all_at_once_and_costs_a_sparse_load_only_its_own_time():
    s, d, w = tiny_shapes(), Deployment("none"), _workload()
    lens = [len(x) for x in w.prompts(100)]
    c = 0.01
    base = simulate_rate(d, s, cpu_profile(), w, lens, math.inf)
    queued = simulate_rate(d, s, cpu_profile(Calibration(arrival_s=c)), w, lens, math.inf)
    ttft = sorted(r["ttft_s"] for r in queued["requests"])
    assert ttft[-1] >= 40 * c  # the last request left the front end at 40 c
    assert queued["summary"]["ttft_p50_s"] > base["summary"]["ttft_p50_s"] + 10 * c
    # at 1 req/s nobody waits for the front end: every TTFT grows by its own cost
    sparse = simulate_rate(d, s, cpu_profile(), w, lens, 1.0)["summary"]
    sparse_q = simulate_rate(d, s, cpu_profile(Calibration(arrival_s=c)), w, lens, 1.0)["summary"]
    assert sparse_q["ttft_p50_s"] - sparse["ttft_p50_s"] == pytest.approx(c, rel=0.05)


def test_profiles_without_the_queue_cost_load_it_as_zero(tmp_path):
    data = cpu_profile(Calibration(step_s=1e-4, token_s=2e-5)).to_json()
    del data["calibration"]["arrival_s"]
    path = tmp_path / "older.json"
    path.write_text(json.dumps(data))
    cal = load_profile(path).calibration
    assert cal.arrival_s == 0.0 and cal.step_s == 1e-4
    assert Calibration(arrival_s=1e-3).active
