"""Device time of GPU work as afd's steps run it: captured in one CUDA graph, so the host's launch cost (20-40 us per
Triton kernel) is not counted. Shared by the device tools under scripts/ and the GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_ms(fn: Callable[[], object], reps: int = 50, rounds: int = 5) -> float:
    """ms per call of `fn`: `reps` calls captured in one CUDA graph (after a warm-up on a side stream, where lazy
    initialisation and Triton compiles happen), the median of `rounds` timed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]
