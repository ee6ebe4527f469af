"""`AFD_TIMELINE=DIR` (`profiling.timeline`, `profiling.timeline_report`): the points each async rank notes and what the
report makes of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd.profiling.timeline_report import attention_phases, main, split_round_trip, step_phases


def _attention(times: list[tuple[int, float, float, float]]) -> list[list]:
    """(layer, send, sent, reply) device times; the host enqueued each send 1 ms before its stream got there."""
    points = []
    for layer, send, sent, reply in times:
        points += [["send", layer, send - 1e-3, send], ["sent", layer, send, sent], ["reply", layer, sent, reply]]
    return points


def test_attention_phases_split_each_exchange():
    points = _attention([(1, 0.010, 0.011, 0.020), (2, 0.025, 0.026, 0.040), (1, 0.100, 0.101, 0.110)])
    phases = attention_phases(points)
    # compute only between layers of one step (layer 2 after layer 1's reply), not across steps
    assert phases["attention compute"] == pytest.approx([0.005])
    assert phases["send"] == pytest.approx([0.001, 0.001, 0.001])
    assert phases["round trip"] == pytest.approx([0.009, 0.014, 0.009])
    assert phases["host lead"] == pytest.approx([1e-3] * 3)
    # the host's own time: layer 2's attention from taking layer 1's reply (0.011) to its send call (0.024)
    assert phases["host: attention"] == pytest.approx([0.013])
    assert phases["host: send"] == pytest.approx([1e-3] * 3)
    assert phases["host: to the reply"] == pytest.approx([0.001, 0.001, 0.001])
    assert phases["shared experts here"] == []  # no "shared" points: the FFN ranks ran them
    shared = [["shared", 1, 0.0105, 0.0114], ["shared", 2, 0.0255, 0.0272], ["shared", 1, 0.1005, 0.1013]]
    assert attention_phases(points + shared)["shared experts here"] == pytest.approx([0.0004, 0.0012, 0.0003])


def test_attention_compute_follows_each_micro_batch_in_ping_pong():
    """m=2: sends of layer 1 for both micro-batches, then each reply resumes its own micro-batch's next layer."""
    points = [
        ["send", 1, 0.000, 0.001], ["sent", 1, 0.000, 0.002],  # micro-batch 0
        ["send", 1, 0.001, 0.003], ["sent", 1, 0.001, 0.004],  # micro-batch 1
        ["reply", 1, 0.002, 0.010],  # micro-batch 0's answer, taken by the host at 0.002
        ["send", 2, 0.003, 0.013], ["sent", 2, 0.003, 0.014],  # micro-batch 0 resumed: 3 ms of attention
        ["reply", 1, 0.004, 0.015],
        ["send", 2, 0.005, 0.017], ["sent", 2, 0.005, 0.018],  # micro-batch 1: 2 ms after its own reply
        ["reply", 2, 0.006, 0.030], ["reply", 2, 0.007, 0.031],
    ]  # fmt: skip
    phases = attention_phases(points)
    assert phases["attention compute"] == pytest.approx([0.003, 0.002])  # never negative, never across batches
    assert phases["round trip"] == pytest.approx([0.008, 0.011, 0.016, 0.013])


def test_step_phases_put_the_engine_steps_around_their_exchanges():
    points = [["launch", -1, 0.000, None], *_attention([(1, 0.004, 0.005, 0.010), (2, 0.012, 0.013, 0.020)]),
              ["tokens", -1, 0.023, None], ["launch", -1, 0.025, None], ["tokens", -1, 0.030, None]]  # fmt: skip
    phases = step_phases(points)
    assert phases["step"] == pytest.approx([0.023, 0.005])
    assert phases["step head"] == pytest.approx([0.004])  # launch -> layer 1's send on the device
    assert phases["step tail"] == pytest.approx([0.003])  # layer 2's reply -> tokens on the host
    assert phases["between steps"] == pytest.approx([0.002])


def test_split_round_trip_matches_items_in_order_and_stops_out_of_step():
    attention = _attention([(1, 0.0, 0.001, 0.010), (2, 0.012, 0.013, 0.030)])
    ffn = [["found", 1, 0.002, None], ["pass", 1, 0.0025, 0.003], ["answered", 1, 0.004, 0.008],
           ["found", 3, 0.015, None], ["pass", 3, 0.016, 0.016], ["answered", 3, 0.017, 0.020]]  # fmt: skip
    parts = split_round_trip(attention, ffn)
    assert parts["FFN host finds it"] == pytest.approx([0.001])  # layer 3 vs layer 2: matching stops
    assert parts["FFN host enqueues"] == pytest.approx([0.002])
    assert parts["FFN stream starts"] == pytest.approx([0.001])
    assert parts["FFN pass + reply writes"] == pytest.approx([0.005])
    assert parts["reply reaches attention"] == pytest.approx([0.002])
    # the parts add up to the round trip the attention stream saw
    assert sum(v[0] for k, v in parts.items() if k != "FFN host enqueues") == pytest.approx(0.009)


def test_report_cli_refuses_an_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert main([str(tmp_path)]) == 2
    assert "no timeline files" in capsys.readouterr().err
