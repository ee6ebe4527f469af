"""Every environment variable afd reads, in one place (the CLI and the runtime ask here, never `os.environ`).

- `AFD_SECRET`: the run's shared secret; every rank of a run must be given the same one. `afd launch`
  mints one per run and hands it to its ranks through the environment (never on a command line).
- `LOCAL_RANK`: torchrun's convention for which local GPU a hand-started rank uses.
- `CUDA_VISIBLE_DEVICES`: which GPUs this process may see.
- `AFD_PROFILE`: a folder; every rank profiles its serving part into it (`profiling.profiler`). Keep such runs short.
- `AFD_API_KEY`: the key `afd serve` requires from clients when `--api-key` is not given (keeps it off `ps`).
"""

from __future__ import annotations

import os

SECRET_VAR = "AFD_SECRET"
API_KEY_VAR = "AFD_API_KEY"


def secret() -> str:
    """The run's shared secret, or '' when none was given (then ranks are not authenticated)."""
    return os.environ.get(SECRET_VAR, "")


def local_rank() -> int | None:
    """torchrun's LOCAL_RANK, or None when unset or not a non-negative integer."""
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else None


def visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries, or None when unset (every GPU is visible)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def log_dir() -> str | None:
    """`AFD_LOG_DIR=DIR`: the ranks' logs of every run that ends well are copied to DIR/<run directory's name>/
    before the run directory goes (a failed run keeps its directory and says where)."""
    return os.environ.get("AFD_LOG_DIR") or None


def profile_dir() -> str | None:
    """`AFD_PROFILE=DIR`: each rank writes a profile of its serving part to DIR (`afd.profiling.profiler.profiled`)."""
    return os.environ.get("AFD_PROFILE") or None


def timeline_dir() -> str | None:
    """`AFD_TIMELINE=DIR`: each p2p and async rank notes a few points per exchange and step (`profiling.timeline`)."""
    return os.environ.get("AFD_TIMELINE") or None


def api_key() -> str | None:
    """`AFD_API_KEY`: the API key `afd serve` requires when no `--api-key` is given; None when unset or empty."""
    return os.environ.get(API_KEY_VAR) or None


def child_environ() -> dict[str, str]:
    """This process's environment for a process it starts (a rank, the zygote): without `AFD_API_KEY`, which only
    the front end reads, so no rank's environment (/proc/PID/environ) shows the server's key."""
    return {k: v for k, v in os.environ.items() if k != API_KEY_VAR}
