"""Which symmetric heap a device gets: POSIX shared memory on CPU, NVSHMEM on CUDA. Kept apart from the interface
(`afd.transport.symm_heap`) so that the interface imports none of its implementations."""

from __future__ import annotations

import torch
import torch.distributed as dist

from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, HeapFactory, SymmetricHeap


def default_heap_factory(
    store: dist.Store,
    world_rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> HeapFactory:
    """CPU → POSIX shared memory, CUDA → NVSHMEM; imported lazily so CPU never needs nvshmem4py."""
    device = torch.device(device)

    def make(nbytes: int) -> SymmetricHeap:
        if device.type == "cpu":
            from afd.transport.shm import ShmHeap

            return ShmHeap(store, world_rank, world_size, nbytes, timeout_s=timeout_s)
        if device.type == "cuda":
            from afd.transport.nvshmem import NvshmemHeap

            return NvshmemHeap(store, world_rank, world_size, nbytes, device=device, timeout_s=timeout_s)
        raise ValueError(f"no symmetric heap for device type '{device.type}'; use cpu or cuda")

    return make
