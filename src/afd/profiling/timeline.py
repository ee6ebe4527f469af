"""Where an exchange's time goes, without a profiler's overhead: `AFD_TIMELINE=DIR`.

Why: a torch.profiler run of a prefill step took ten times as long as the step (every flag poll of the FFN
rank is an operator it records), so its timeline could not say where the unprofiled step's time goes. Here each
rank notes a few named points per exchange: the host's time (`time.perf_counter`, one clock for every process
of a host) and, on CUDA, an event on the current stream. At the end each event is put on the host clock through
one event that the host waited for, so the points of all ranks line up to within some tens of microseconds.
`afd.profiling.timeline_report` (`python -m afd.profiling.timeline_report DIR`) reads the files back.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from afd import env

logger = logging.getLogger(__name__)


class Timeline:
    """Named points of one rank; `dump()` writes DIR/NAME.json: {"name", "points": [[key, layer, host_s,
    device_s or null], ...]} with both times on the host's perf_counter clock."""

    def __init__(self, name: str, folder: str, device: torch.device) -> None:
        self.name, self.folder, self.device = name, folder, device
        self._points: list[tuple[str, int, float, torch.cuda.Event | None]] = []
        self._base: tuple[torch.cuda.Event, float] | None = None
        if device.type == "cuda":
            base = torch.cuda.Event(enable_timing=True)
            base.record(torch.cuda.current_stream(device))
            base.synchronize()
            self._base = (base, time.perf_counter())

    @classmethod
    def from_env(cls, name: str, device: torch.device | str) -> Timeline | None:
        folder = env.timeline_dir()
        return cls(name, folder, torch.device(device)) if folder else None

    def mark(self, key: str, layer: int = -1, *, on_device: bool = True) -> None:
        """Note `key` now on the host and, with `on_device` on CUDA, when the current stream reaches it."""
        event = None
        if on_device and self._base is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
        self._points.append((key, layer, time.perf_counter(), event))

    def dump(self) -> Path | None:
        """Write the points (waits for the stream to pass the last event); never raises (a diagnostic)."""
        try:
            rows = []
            if self._base is not None:
                torch.cuda.synchronize(self.device)
            for key, layer, host_s, event in self._points:
                device_s = None
                if event is not None and self._base is not None:
                    base, base_host = self._base
                    device_s = base_host + base.elapsed_time(event) / 1e3
                rows.append([key, layer, host_s, device_s])
            path = Path(self.folder, f"{self.name}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"name": self.name, "points": rows}))
            return path
        except Exception as e:  # noqa: BLE001 - a diagnostic must not fail the run it watches
            logger.warning("timeline %s not written: %s", self.name, e)
            return None
