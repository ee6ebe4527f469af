"""Where one process's time goes, on request: `profiled(name, folder)` around a rank's work.

`afd bench exchange` turns it on with `AFD_BENCH_PROFILE=DIR`; every rank of `afd launch`, `afd bench` and
`afd serve` with `AFD_PROFILE=DIR` (its serving part: the attention engine's steps, the FFN loop). DIR/NAME.txt
holds the Python functions by own time (cProfile) and the torch operators and kernels by self time
(torch.profiler); DIR/NAME.trace.json is the timeline (chrome://tracing, Perfetto). Keep such runs short.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def profiled(name: str, folder: str | None) -> Iterator[None]:
    """Profile the block into `folder`/`name`.*; a no-op when `folder` is None or empty."""
    if not folder:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    python = cProfile.Profile()
    with torch.profiler.profile(activities=activities) as ops:
        python.enable()
        try:
            yield
        finally:
            python.disable()
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(35)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    table2 = ops.key_averages().table(sort_by=sort, row_limit=20) if sort != "self_cpu_time_total" else ""
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, f"{name}.txt").write_text(text.getvalue() + "\n" + table + "\n" + table2)
    ops.export_chrome_trace(str(Path(folder, f"{name}.trace.json")))
