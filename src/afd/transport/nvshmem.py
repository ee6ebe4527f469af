"""GPU symmetric heap: NVSHMEM through nvshmem4py, bootstrapped over the AFD world store.

Why NVSHMEM and not torch's symmetric memory: the AFD world (attention + FFN ranks) is the whole
NVSHMEM world, with PE == AFD world rank; no process group covers it, so no team split is needed
and none is attempted.

Bootstrap (seen working, see shared/probes/nvshmem_bootstrap.py):
  1. every rank publishes host / GPU uuid / window size through the store and waits (bounded by
     the connector's timeout, naming the world ranks that never published) for all of them; a
     second host (single node only), an unequal number of ranks per GPU (3 PEs on 2 GPUs hung in
     init) or an unequal window size is refused *before* init, which would otherwise hang;
  2. NVSHMEM_SYMMETRIC_SIZE is derived from the window size (unless already large enough);
  3. world rank 0 mints a unique id, the others read it from the store (bounded); init with "uid";
  4. `my_pe() == world_rank` is asserted; one symmetric uint8 tensor is the window;
  5. peers are mapped with `get_peer_tensor` (nvshmem_ptr): a failed / NULL mapping means the
     peer is not P2P-reachable, a hard error (single node with NVLink/P2P only).

`nvshmem.init` itself is collective and has no timeout of ours: a peer killed after publishing its
placement but before init leaves the others inside init. That wait is bounded by the AFD world's
heartbeat watchdog (afd.distributed.world), which ends a rank whose peer went silent and names that peer;
nothing here can interrupt init.

close() never frees or finalizes: `nvshmem free` and `finalize` are collective, so a rank that
closes while a peer is still running (or dead) would block forever — finalize was seen not
returning within 75 s. The window is kept referenced until process exit, which reclaims it; the
launcher should end NVSHMEM processes with `os._exit` after close for the same reason.

Write ordering: the payload and the flag are copied on the same stream; same-stream copies into
NVLink-mapped memory complete in issue order. A cross-node transport would need a fence.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, SymmetricHeap, store_get, wait_keys

logger = logging.getLogger("afd.transport.nvshmem")

_UID_KEY = "afd_nvshmem/uid"
_PLACEMENT_KEY = "afd_nvshmem/placement"
_HEAP_ALIGN = 2 << 20  # NVSHMEM maps the heap in 2 MiB granules
_HEAP_SLACK = 256 << 20  # NVSHMEM's own symmetric allocations (psync arrays, teams)

# Windows stay referenced for the life of the process: dropping the last reference could
# trigger a collective free (see the module docstring).
_KEEP_ALIVE: list[Any] = []
_INITIALIZED = False


def _import_nvshmem() -> Any:
    try:
        import nvshmem.core as nvshmem
    except ImportError as e:
        raise RuntimeError(
            "the async connector on CUDA needs NVSHMEM's Python bindings; install them with "
            "`pip install 'afd[gpu]'` (nvshmem4py-cu13), or run on CPU"
        ) from e
    return nvshmem


def _cuda_core_device(index: int) -> Any:
    try:
        from cuda.core import Device  # cuda-core >= 1.0
    except ImportError:
        from cuda.core.experimental import Device
    dev = Device(index)
    dev.set_current()
    return dev


def _gpu_identity(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    # CUDA_VISIBLE_DEVICES may give two ranks the same index for different GPUs: prefer the uuid.
    return str(uuid) if uuid is not None else f"{socket.gethostname()}:cuda{index}"


def check_placement(placements: list[dict]) -> None:
    """Refuse placements NVSHMEM cannot serve; `placements[r]` = {host, gpu, nbytes} of world rank r.

    Pure (no store) so it is unit-testable without GPUs.
    """
    hosts = sorted({p["host"] for p in placements})
    if len(hosts) > 1:
        raise RuntimeError(
            f"the async connector on CUDA is single node only, but ranks run on hosts {hosts}; "
            "run every rank on one node or use the p2p connector"
        )
    sizes = {p["nbytes"] for p in placements}
    if len(sizes) > 1:
        detail = ", ".join(f"world rank {r}: {p['nbytes']}" for r, p in enumerate(placements))
        raise RuntimeError(
            f"ranks asked for different NVSHMEM window sizes ({detail}); start every rank with the "
            "same model and connector settings"
        )
    per_gpu: dict[str, list[int]] = defaultdict(list)
    for r, p in enumerate(placements):
        per_gpu[p["gpu"]].append(r)
    counts = {len(ranks) for ranks in per_gpu.values()}
    if len(counts) > 1:
        layout = "; ".join(f"GPU {gpu}: world ranks {ranks}" for gpu, ranks in per_gpu.items())
        raise RuntimeError(
            f"NVSHMEM needs the same number of ranks on every GPU (unbalanced placement hangs in "
            f"nvshmem init), got {layout}; place ranks evenly over the GPUs"
        )


def exchange_placement(
    store: dist.Store, world_rank: int, world_size: int, mine: dict, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[dict]:
    """Publish this rank's placement and read every rank's, waiting at most `timeout_s`.

    A timeout names the world ranks that never published (they died or never started), so nobody
    enters the collective `nvshmem.init` without every peer having reached this point.
    """
    store.set(f"{_PLACEMENT_KEY}/{world_rank}", json.dumps(mine))
    keys = [f"{_PLACEMENT_KEY}/{r}" for r in range(world_size)]
    try:
        wait_keys(store, keys, timeout_s, f"GPU placement of all {world_size} NVSHMEM ranks")
    except TimeoutError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise TimeoutError(
            f"world rank {world_rank} waited {timeout_s:.1f}s for the GPU placement of world ranks {missing} "
            "before NVSHMEM init; they died or were never started"
        ) from None
    return [json.loads(store.get(k)) for k in keys]


def heap_size_for(nbytes: int) -> int:
    """Symmetric heap bytes for one window of `nbytes`: window + slack, rounded to 2 MiB."""
    need = nbytes + _HEAP_SLACK
    return -(-need // _HEAP_ALIGN) * _HEAP_ALIGN


def _parse_size(text: str) -> int | None:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if text and text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(text)
    except ValueError:
        return None


def _set_heap_size(nbytes: int) -> None:
    need = heap_size_for(nbytes)
    current = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    have = _parse_size(current) if current else None
    if have is not None and have >= need:
        return
    if current:
        logger.warning("NVSHMEM_SYMMETRIC_SIZE=%s is below the %d bytes the window needs; raising it", current, need)
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(need)


WaitValue = Callable[[int, int, int], None]  # (device address of an int64, value, stream handle)


def _device_wait(ranks_on_my_gpu: int) -> WaitValue | None:
    """How a stream waits for `flag >= value` here. With one rank per GPU, NVSHMEM's `signal_wait_until_on_stream`
    (a one-thread kernel that spins). With several ranks per GPU NVSHMEM refuses that call ("not supported with
    limited MPG") and ends the process, so there the CUDA driver's `cuStreamWaitValue64` on the local address (a
    stream memory operation, no SM spins). None (host polling) when neither is available."""
    if ranks_on_my_gpu == 1:
        import nvshmem.bindings as bindings

        ge = int(bindings.Cmp_type.CMP_GE)
        return lambda addr, value, stream: bindings.signal_wait_until_on_stream(addr, ge, value, stream)
    try:
        from cuda.bindings import driver
    except ImportError:
        logger.info("no cuda-bindings: async replies are polled from the host (%d ranks on this GPU)", ranks_on_my_gpu)
        return None
    geq = int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

    def wait(addr: int, value: int, stream: int) -> None:
        (err,) = driver.cuStreamWaitValue64(driver.CUstream(stream), driver.CUdeviceptr(addr), value, geq)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamWaitValue64 failed: {err}")

    return wait


class NvshmemHeap(SymmetricHeap):
    """Symmetric window in NVSHMEM memory; `peer_view(r)` is a device tensor aliasing PE r's window."""

    def __init__(
        self,
        store: dist.Store,
        world_rank: int,
        world_size: int,
        nbytes: int,
        *,
        device: torch.device | str | int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        global _INITIALIZED
        super().__init__(store, world_rank, world_size, nbytes)
        if _INITIALIZED:
            raise RuntimeError("NVSHMEM is initialized once per process; create a single NvshmemHeap")
        nvshmem = _import_nvshmem()
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(index)

        mine = {"host": socket.gethostname(), "gpu": _gpu_identity(index), "nbytes": nbytes}
        placements = exchange_placement(store, world_rank, world_size, mine, timeout_s)
        check_placement(placements)
        self._ranks_on_my_gpu = sum(p["gpu"] == mine["gpu"] for p in placements)

        _set_heap_size(nbytes)
        dev = _cuda_core_device(index)
        uid = nvshmem.get_unique_id(empty=(world_rank != 0))
        uid_bytes = uid._data.view("int8")  # 128-byte opaque id
        if world_rank == 0:
            store.set(_UID_KEY, uid_bytes.tobytes())
        else:
            import numpy as np

            raw = store_get(store, _UID_KEY, timeout_s, "the NVSHMEM unique id from world rank 0")
            uid_bytes[:] = np.frombuffer(raw, dtype=np.int8)
        logger.info(
            "world rank %d: nvshmem init (%d PEs, heap %d bytes)", world_rank, world_size, heap_size_for(nbytes)
        )
        # collective, no timeout of its own: the world's heartbeat watchdog bounds it (module docstring)
        nvshmem.init(device=dev, uid=uid, rank=world_rank, nranks=world_size, initializer_method="uid")
        _INITIALIZED = True
        if nvshmem.my_pe() != world_rank or nvshmem.n_pes() != world_size:
            raise RuntimeError(
                f"NVSHMEM numbered this rank PE {nvshmem.my_pe()} of {nvshmem.n_pes()}, expected "
                f"PE {world_rank} of {world_size} (PE must equal the AFD world rank)"
            )

        self.local = nvshmem.interop.torch.tensor((nbytes,), dtype=torch.uint8)  # [nbytes] symmetric
        _KEEP_ALIVE.append(self.local)
        self.local.zero_()
        torch.cuda.synchronize(index)
        self._views[world_rank] = self.local
        for r in range(world_size):
            if r != world_rank:
                self._views[r] = self._map_peer(nvshmem, r)
        _KEEP_ALIVE.extend(self._views.values())
        self._wait = _device_wait(self._ranks_on_my_gpu)
        self.device_waits = self._wait is not None

    def _map_peer(self, nvshmem: Any, peer: int) -> torch.Tensor:
        try:
            view = nvshmem.interop.torch.get_peer_tensor(self.local, peer)
        except Exception as e:
            raise RuntimeError(
                f"cannot map world rank {peer}'s NVSHMEM window ({e}); the async connector on CUDA is "
                "single node only and needs P2P/NVLink between all GPUs"
            ) from e
        if view is None or view.data_ptr() == 0:
            raise RuntimeError(
                f"world rank {peer}'s NVSHMEM window has no peer pointer (nvshmem_ptr returned NULL): "
                "the async connector on CUDA is single node only and needs P2P/NVLink between all GPUs"
            )
        return view

    def wait_on_stream(self, offset: int, value: int, stream: torch.cuda.Stream) -> None:
        """The stream stalls on the device until the int64 flag at `offset` is >= `value` (a stream memory
        operation, no SM spins); the host goes on."""
        if self._wait is None:
            raise NotImplementedError("this NVSHMEM heap has no device-side wait; poll from the host")
        if offset % 8 or not 0 <= offset <= self.nbytes - 8:
            raise ValueError(f"a flag needs 8 aligned bytes inside the window, got offset {offset}")
        self._wait(self.local.data_ptr() + offset, value, stream.cuda_stream)

    def close(self) -> None:
        """Stop handing out views; deliberately no nvshmem free/finalize (collective, may hang)."""
        self._closed = True
