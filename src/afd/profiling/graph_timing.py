"""Device time of work replayed from one CUDA graph, as afd's steps run it: the host's launch cost is not counted."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_ms(fn: Callable[[], object], replays: int) -> float:
    """ms per replay of `fn` captured in one CUDA graph: warmed up on a side stream (lazy initialisation, Triton
    compiles), captured, replayed once, then `replays` times between two events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays
