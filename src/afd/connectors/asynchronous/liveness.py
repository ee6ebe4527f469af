"""Whether a peer process is still alive: both transports are single host, so a pid check is exact; the
process start time (from /proc) tells a reused pid apart."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any


def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2 :].split()
    return f"{rest[0]}:{rest[19]}"  # state, start time (field 22)


def proc_info() -> dict[str, Any]:
    start = _proc_start(os.getpid())
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": start.split(":")[1] if start else None}


def is_alive(info: Mapping[str, Any]) -> bool:
    if info.get("host") != socket.gethostname():
        return True  # cannot tell from here
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_start(int(info["pid"]))
    if stat is None:
        return True
    state, start = stat.split(":")
    return state not in ("Z", "X") and (info.get("start") is None or start == info["start"])
