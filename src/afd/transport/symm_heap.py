"""One symmetric byte window per rank, mapped into every other rank of the AFD world.

The `async` connector needs exactly three things from a transport: a local window of N bytes
that every rank allocates with the same size, a tensor aliasing each peer's window (a one-sided
`copy_` into it is a remote write), and a barrier. `SymmetricHeap` is that narrow interface;
`ShmHeap` (CPU, POSIX shared memory) and `NvshmemHeap` (GPU, NVSHMEM) implement it.

Everything rendezvouses through the AFD world store (a `torch.distributed.Store`, possibly a
`PrefixStore`): no extra host:port pairs. Every wait is bounded and names what it waited for.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger("afd.transport.symm_heap")

DEFAULT_TIMEOUT_S = 120.0

# (nbytes) -> heap; lets a connector size the window before the heap exists.
HeapFactory = Callable[[int], "SymmetricHeap"]


def wait_keys(store: dist.Store, keys: Sequence[str], timeout_s: float, what: str) -> None:
    """Wait until every key exists; on timeout, raise naming `what` and the missing keys.

    Polls `check` instead of `store.wait` so the error can list exactly who never arrived.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(keys)
    delay = 0.001
    while True:
        pending = [k for k in pending if not store.check([k])]
        if not pending:
            return
        if time.monotonic() >= deadline:
            shown = ", ".join(pending[:8]) + (" ..." if len(pending) > 8 else "")
            raise TimeoutError(
                f"timed out after {timeout_s:.1f}s waiting for {what}; still missing store keys: {shown}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def store_barrier(store: dist.Store, name: str, world_rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank sets `name/<rank>` and waits for all of them; `name` must be unique per use."""
    store.set(f"{name}/{world_rank}", "1")
    wait_keys(
        store,
        [f"{name}/{r}" for r in range(world_size)],
        timeout_s,
        f"barrier '{name}' of {world_size} ranks",
    )


def store_get(store: dist.Store, key: str, timeout_s: float, what: str) -> bytes:
    """`store.get` with a bounded wait and an error that says what was expected."""
    wait_keys(store, [key], timeout_s, what)
    return store.get(key)


class SymmetricHeap(ABC):
    """One symmetric uint8 window of `nbytes` per rank, plus views of every peer's window.

    `local`: [nbytes] uint8 on `device`. `peer_view(r)`: [nbytes] uint8 aliasing rank r's window
    (for r == world_rank it is `local`). Writes into a peer view are one-sided.
    """

    world_rank: int
    world_size: int
    nbytes: int
    local: torch.Tensor

    def __init__(self, store: dist.Store, world_rank: int, world_size: int, nbytes: int) -> None:
        if not 0 <= world_rank < world_size:
            raise ValueError(f"world_rank {world_rank} is outside a world of {world_size} ranks")
        if nbytes <= 0:
            raise ValueError(f"a symmetric window needs a positive size, got {nbytes} bytes")
        self.store = store
        self.world_rank = world_rank
        self.world_size = world_size
        self.nbytes = nbytes
        self._barrier_count = 0
        self._views: dict[int, torch.Tensor] = {}
        self._closed = False
        self.generation = 0  # > 0: a restarted rank that joined a running world (only `ShmHeap` can)

    @property
    def device(self) -> torch.device:
        return self.local.device

    def peer_view(self, world_rank: int) -> torch.Tensor:
        """[nbytes] uint8 tensor aliasing `world_rank`'s window (mapped once, at init, into `_views`)."""
        if self._closed:
            raise RuntimeError(f"the {type(self).__name__} is closed")
        try:
            return self._views[world_rank]
        except KeyError:
            raise ValueError(f"no window for world rank {world_rank} in a world of {self.world_size}") from None

    def barrier(self, tag: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Store barrier over the whole world; every rank must call it with the same tags in order. A rank that
        joined a running world (`generation` > 0) passes at once: the others are past their barriers."""
        if self.generation:
            return
        self._barrier_count += 1
        store_barrier(
            self.store,
            f"afd_heap/barrier/{tag}/{self._barrier_count}",
            self.world_rank,
            self.world_size,
            timeout_s,
        )

    def wait_on_stream(self, offset: int, value: int, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait, on the device, until the int64 at byte `offset` of the local window is >= `value`.

        Only heaps with `device_waits` implement it (NVSHMEM); the others are polled from the host.
        """
        raise NotImplementedError(f"{type(self).__name__} has no device-side wait; poll from the host")

    device_waits = False  # whether `wait_on_stream` exists (the window's receivers then skip the host poll)

    def remap(self, world_rank: int, generation: int) -> None:
        """Map restart `generation` of `world_rank`'s window in place of the old one (`ShmHeap` only)."""
        raise NotImplementedError(f"a {type(self).__name__} cannot map a restarted rank: its world is fixed at init")

    def release_name(self) -> None:
        """Drop this rank's window name once its peers mapped it (a heap without names has nothing to drop)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release this rank's resources; never blocks on peers and never raises."""
