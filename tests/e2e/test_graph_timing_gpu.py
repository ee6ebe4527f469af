"""`afd.profiling.graph_timing.graph_ms` on a GPU: it replays the captured work, and its time grows with it."""

from __future__ import annotations

import pytest
import torch

from afd.profiling.graph_timing import graph_ms

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_ms_times_the_captured_work() -> None:
    x = torch.zeros(1 << 20, device="cuda")
    one = graph_ms(lambda: x.add_(1), reps=2, rounds=10)
    assert x[0].item() == 3 + 2 + 2 * 10  # the warm-up, the first replay after the capture, then 10 timed ones
    many = graph_ms(lambda: [x.add_(1) for _ in range(50)], reps=2, rounds=10)
    assert 0 < one < many
