"""Progress of `afd bench serve` on stderr: a bar on a terminal, plain lines in a log.

The bar is `tqdm`'s when it is installed (it is on the GPU image) and a line rewritten in place otherwise;
`tqdm` is never required. Off a terminal only milestones are written (a server starts, a run ends), so a
log holds a few lines per run, not one per request.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Silent: what the library does unless the caller asks for more."""

    def note(self, message: str) -> None:
        """A milestone (a server starts)."""

    def start(self, label: str, total: int) -> None:
        """A run of `total` requests begins."""

    def advance(self) -> None:
        """One request of the run ended (success or error)."""

    def finish(self) -> None:
        """The run ended; the bar, if any, is closed."""


class LineProgress(Progress):
    """Plain lines: milestones and the end of each run; on a terminal also the count, rewritten in place."""

    def __init__(self, stream: TextIO, prefix: str, in_place: bool) -> None:
        self.stream, self.prefix, self.in_place = stream, prefix, in_place
        self.label, self.total, self.done, self.started = "", 0, 0, 0.0

    def _write(self, text: str, final: bool) -> None:
        if self.in_place:
            self.stream.write(f"\r{self.prefix} {text}\033[K" + ("\n" if final else ""))
        elif final:
            self.stream.write(f"{self.prefix} {text}\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        self._write(message, True)

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.started = label, total, 0, time.perf_counter()
        self._write(f"{label}: 0/{total} requests", not self.in_place)

    def advance(self) -> None:
        self.done += 1
        self._write(f"{self.label}: {self.done}/{self.total} requests", False)

    def finish(self) -> None:
        elapsed = time.perf_counter() - self.started
        self._write(f"{self.label}: {self.done}/{self.total} requests in {elapsed:.1f} s", True)


class BarProgress(Progress):
    """A `tqdm` bar per run (the module is passed in: imported only where it exists)."""

    def __init__(self, tqdm_module, stream: TextIO, prefix: str) -> None:
        self.tqdm, self.stream, self.prefix, self.bar = tqdm_module, stream, prefix, None

    def note(self, message: str) -> None:
        self.tqdm.tqdm.write(f"{self.prefix} {message}", file=self.stream)

    def start(self, label: str, total: int) -> None:
        self.bar = self.tqdm.tqdm(total=total, desc=label, unit="req", file=self.stream, leave=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def stderr_progress(prefix: str = "[afd bench serve]", stream: TextIO | None = None) -> Progress:
    """A bar when `stream` (stderr) is a terminal — tqdm's if installed —, plain milestone lines otherwise."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return LineProgress(stream, prefix, in_place=False)
    try:
        import tqdm
    except ImportError:
        return LineProgress(stream, prefix, in_place=True)
    return BarProgress(tqdm, stream, prefix)
