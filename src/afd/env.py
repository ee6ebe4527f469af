"""Every environment variable afd reads, in one place (the CLI and the runtime ask here, never `os.environ`).

- `AFD_SECRET`: the run's shared secret; every rank of a run must be given the same one. `afd launch`
  mints one per run and hands it to its ranks through the environment (never on a command line).
- `AFD_LAUNCHER_PID`: set by `afd launch` for its ranks; a rank whose launcher is gone stops.
- `AFD_ZYGOTE`: set to 0 to start every rank of a launch as a process of its own instead of forking it from one
  process that imported torch once (`afd.runtime.zygote`). `AFD_ZYGOTE_PID` is set in a forked rank (its parent).
- `LOCAL_RANK`: torchrun's convention for which local GPU a hand-started rank uses.
- `CUDA_VISIBLE_DEVICES`: which GPUs this process may see.
- `AFD_PROFILE`: a folder; every rank profiles its serving part into it (`profiling.profiler`). Keep such runs short.
- `AFD_API_KEY`: the key `afd serve` requires from clients when `--api-key` is not given (keeps it off `ps`).
- `AFD_FFN_GRAPHS`: set to 0 to run FFN ranks' expert passes eagerly instead of replaying CUDA graphs.
- `AFD_PREFILL_GRAPHS`: set to 0 to run steps with prompt tokens eagerly instead of replaying their row-wise pieces
  from CUDA graphs at padded token counts (`afd.engine.graphs.prefill`).
- `AFD_FFN_CHAIN`: set to 0 to make a 1A1F async FFN rank on CUDA discover every request from the host instead of
  enqueueing whole passes on the device (`asynchronous.ffn_chain`); 1 runs those passes on CPU too (tests).
- `AFD_EXCHANGE_GRAPHS`: set to 0 to keep a 1A1F async attention rank's decode graphs in pieces between exchanges
  (the exchange then runs eagerly) instead of capturing the whole step, exchanges included.
- `AFD_STREAM_WAIT`: `memop` makes CUDA streams wait for async flags with the driver's stream memory operation
  (no SM spins), `nvshmem` with NVSHMEM's waiting kernel (one rank per GPU only; afd.transport.nvshmem).
- `AFD_ASYNC_HOST_WAIT`: set to 1 to make the async connector's attention ranks poll for replies from the host
  on CUDA, as on CPU, instead of waiting on their stream (a comparison, or a suspected device-wait problem).
"""

from __future__ import annotations

import os

SECRET_VAR = "AFD_SECRET"
LAUNCHER_PID_VAR = "AFD_LAUNCHER_PID"
ZYGOTE_PID_VAR = "AFD_ZYGOTE_PID"
API_KEY_VAR = "AFD_API_KEY"


def secret() -> str:
    """The run's shared secret, or '' when none was given (then ranks are not authenticated)."""
    return os.environ.get(SECRET_VAR, "")


def launcher_pid() -> int | None:
    """The pid of the `afd launch` that started this rank, or None for a rank started by hand."""
    value = os.environ.get(LAUNCHER_PID_VAR, "")
    return int(value) if value.isdigit() else None


def zygote_enabled() -> bool:
    """`AFD_ZYGOTE=0`: a launcher starts each rank as a process of its own (`afd.runtime.zygote` says why not)."""
    return os.environ.get("AFD_ZYGOTE", "") != "0"


def zygote_pid() -> int | None:
    """The pid of the zygote that forked this rank (its parent), or None for a rank started as a process."""
    value = os.environ.get(ZYGOTE_PID_VAR, "")
    return int(value) if value.isdigit() else None


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


def prefill_graphs_disabled() -> bool:
    """`AFD_PREFILL_GRAPHS=0`: steps with prompt tokens run eagerly (a comparison, or a suspected capture problem)."""
    return os.environ.get("AFD_PREFILL_GRAPHS", "1") == "0"


def ffn_graphs_disabled() -> bool:
    """`AFD_FFN_GRAPHS=0`: FFN ranks run their expert passes eagerly (a suspected graph problem, or timing)."""
    return os.environ.get("AFD_FFN_GRAPHS", "") == "0"


def ffn_chain() -> bool | None:
    """`AFD_FFN_CHAIN`: False for 0, True for 1, None (the default: on where it applies on CUDA) otherwise."""
    value = os.environ.get("AFD_FFN_CHAIN", "")
    return False if value == "0" else True if value == "1" else None


def log_dir() -> str | None:
    """`AFD_LOG_DIR=DIR`: the ranks' logs of every run that ends well are copied to DIR/<run directory's name>/
    before the run directory goes (a failed run keeps its directory and says where)."""
    return os.environ.get("AFD_LOG_DIR") or None


def busy_poll() -> bool:
    """`AFD_BUSY_POLL=1`: a server's front end and its replicas poll without sleeping while idle (a core each), so
    a request and its first token skip the wake-ups from idle (~0.1-0.25 ms each) on their way."""
    return os.environ.get("AFD_BUSY_POLL", "") == "1"


def ffn_pass_graphs_disabled() -> bool:
    """`AFD_FFN_PASS_GRAPHS=0`: the FFN's device chain replays one graph per layer (and a wait before each)
    instead of one graph per whole pass."""
    return os.environ.get("AFD_FFN_PASS_GRAPHS", "") == "0"


def exchange_graphs_disabled() -> bool:
    """`AFD_EXCHANGE_GRAPHS=0`: decode graphs never capture a disaggregated exchange."""
    return os.environ.get("AFD_EXCHANGE_GRAPHS", "") == "0"


def stream_wait() -> str:
    """`AFD_STREAM_WAIT`: 'memop', 'nvshmem', or '' (the default of afd.transport.nvshmem)."""
    value = os.environ.get("AFD_STREAM_WAIT", "")
    return value if value in ("memop", "nvshmem") else ""


def async_host_wait() -> bool:
    """`AFD_ASYNC_HOST_WAIT=1`: async attention ranks poll replies from the host on CUDA too."""
    return os.environ.get("AFD_ASYNC_HOST_WAIT", "") not in ("", "0")


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
