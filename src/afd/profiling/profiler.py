"""Where one process's time goes, on request: `profiled(name, folder)` around a rank's work.

`AFD_PROFILE=DIR` turns it on for every rank of `afd launch`, `afd bench`, `afd bench exchange` and `afd serve`
(its serving part: the attention engine's steps, the FFN loop; an exchange rank's timed passes). DIR/NAME.txt
holds the Python functions by own time (cProfile) and the torch operators and kernels by self time
(torch.profiler); DIR/NAME.trace.json is the timeline (chrome://tracing, Perfetto). Keep such runs short.

Always on, for CUDA ranks: `watching_compiles` logs every Triton kernel variant compiled during the serving part
(one the warm-up missed) and a count at its end.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import logging
import pstats
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


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


class CompileWatch:
    """The Triton kernel variants this process compiles (or loads from Triton's disk cache) before its serving part
    starts and after. One after is a first use inside timed or served work that the warm-up (`afd.engine.warm_up`, the
    graph captures) did not cover: it lands in some request's latency (a fresh machine's first run once paid
    ~260 ms of TTFT for it). Triton calls it after each compile (`triton.knobs.runtime.jit_post_compile_hook`)."""

    def __init__(self, chained: Callable[..., object] | None = None) -> None:
        self.before = 0
        self.after: list[str] = []  # each variant compiled while serving: the kernel and its specialization
        self.serving = False
        self._chained = chained  # a hook that was installed before this one

    def __call__(self, **hook_args: object) -> object:
        """Triton's post-compile hook; keyword arguments only (their set differs between Triton versions: only
        `repr` is read, and a missing one never fails a compile)."""
        what = str(hook_args.get("repr", "?"))
        if self.serving:
            self.after.append(what)
            logger.info("Triton compiled %s while serving (the warm-up did not)", what)
        else:
            self.before += 1
        return self._chained(**hook_args) if self._chained is not None else None

    def summary(self) -> str:
        kernels = sorted({r.partition("[")[0].partition("(")[0] for r in self.after})
        names = f": {', '.join(kernels)}" if kernels else ""
        return f"Triton: {self.before} kernel variants compiled before serving, {len(self.after)} while serving{names}"


_WATCH: CompileWatch | None = None


def watch_compiles() -> CompileWatch | None:
    """This process's compile watch, installed on first call; None where Triton is not installed."""
    global _WATCH
    if _WATCH is None:
        try:
            import triton.knobs
        except ImportError:
            return None
        _WATCH = CompileWatch(triton.knobs.runtime.jit_post_compile_hook)
        triton.knobs.runtime.jit_post_compile_hook = _WATCH
    return _WATCH


@contextlib.contextmanager
def watching_compiles(enabled: bool) -> Iterator[None]:
    """Around a rank's serving part (CUDA: `enabled`): compiles inside it are counted apart and logged, and a
    summary is logged at its end."""
    watch = watch_compiles() if enabled else None
    if watch is None:
        yield
        return
    watch.serving = True
    try:
        yield
    finally:
        watch.serving = False
        logger.info("%s", watch.summary())
