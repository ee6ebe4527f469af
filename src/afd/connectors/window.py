"""The `async` connector's wire format: slot layout, in-band header, one-sided write, poll.

    window = [ flag[num_regions * ring_depth] int64 | slot(0,0) | slot(0,1) | ... ]
    slot   = [ header | route_table | routed_x | shared_idx | shared_x ]   every field 256 B aligned

A sender writes only region == its own role rank of the receiver's window, so every offset is
computed locally and no remote atomics are needed. Dispatch (A→F) and combine (F→A) share one
slot layout. Write order: payload, header, then the flag (the sender's monotonically increasing
seq) — same stream on GPU, program order on CPU. The receiver keeps a host mirror of the flag
values it has seen; `poll` reads all flags at once and returns the first changed slot, starting
its scan after the last hit so no region starves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from afd.connectors.wire import (
    HEADER_WORDS,
    SlotHeader,
    SlotViews,
    WindowGeometry,
    WindowOverflow,
    WindowProtocolError,
    check_geometry,
    decode_header,
    encode_header,
)
from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, HeapFactory, SymmetricHeap

logger = logging.getLogger("afd.connectors.window")


@dataclass
class Message:
    """One received slot; tensors are zero-copy views into the local window, trimmed to the counts."""

    region: int  # sender's role rank
    stage: int
    header: SlotHeader
    route_table: torch.Tensor  # [routed_tokens] int32
    routed_x: torch.Tensor  # [routed_tokens, hidden]
    shared_idx: torch.Tensor  # [shared_tokens] int32
    shared_x: torch.Tensor  # [shared_tokens, hidden]


class Window:
    """One rank's symmetric window plus one-sided writes into peers' windows."""

    def __init__(self, heap: SymmetricHeap, geometry: WindowGeometry, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        if heap.nbytes < geometry.nbytes:
            raise ValueError(f"heap of {heap.nbytes} bytes cannot hold a window of {geometry.nbytes}")
        self.heap = heap
        self.geometry = geometry
        self.layout = geometry.layout
        self.device = heap.device
        self._is_cuda = self.device.type == "cuda"
        # zero, then barrier, then peers may write (zeroing after a peer's write erased its flag)
        heap.local[: geometry.nbytes].zero_()
        if self._is_cuda:
            torch.cuda.synchronize(self.device)
        heap.barrier("window_zeroed", timeout_s)

        n = geometry.num_slots
        self._flags = self._flag_view(heap.local)  # [num_slots] int64
        self._local_slots = [self._slot_views(heap.local, i) for i in range(n)]
        self._seen = [0] * n  # host mirror of the flag values already returned
        self._scan = 0
        self._seq = 0  # this rank's send counter: every flag it writes is a new, larger value
        self._peer_flags: dict[int, torch.Tensor] = {}
        self._staging: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        pin = self._is_cuda
        self._host_flags = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._host_header = torch.zeros(HEADER_WORDS + self.layout.experts_per_rank, dtype=torch.int32, pin_memory=pin)
        self._poll_stream = torch.cuda.Stream(self.device) if self._is_cuda else None

    @classmethod
    def create(
        cls,
        store: dist.Store,
        world_rank: int,
        world_size: int,
        geometry: WindowGeometry,
        heap_factory: HeapFactory,
        *,
        namespace: str = "afd_async",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Window:
        """Check geometry with every peer, log the size, allocate the heap, zero, barrier."""
        check_geometry(store, world_rank, world_size, geometry.as_dict(), namespace=namespace, timeout_s=timeout_s)
        if world_rank == 0:
            logger.info("async window per rank: %s", geometry.describe())
        else:
            logger.debug("async window per rank: %s", geometry.describe())
        heap = heap_factory(geometry.nbytes)
        try:
            return cls(heap, geometry, timeout_s=timeout_s)
        except BaseException:
            heap.close()
            raise

    # -- views ---------------------------------------------------------------------------------

    def _flag_view(self, window: torch.Tensor) -> torch.Tensor:
        return window[: 8 * self.geometry.num_slots].view(torch.int64)

    def _slot_views(self, window: torch.Tensor, index: int) -> SlotViews:
        start = self.geometry.flags_bytes + index * self.layout.slot_bytes
        return self.layout.views(window[start : start + self.layout.slot_bytes])

    # -- send ----------------------------------------------------------------------------------

    @torch.inference_mode()  # staging buffers may be first made inside the engine's inference mode
    def write_slot(
        self,
        peer: int,
        region: int,
        stage: int,
        header: SlotHeader,
        *,
        route_table: torch.Tensor | None = None,  # [routed] int32
        routed_x: torch.Tensor | None = None,  # [routed, hidden]
        shared_idx: torch.Tensor | None = None,  # [shared] int32
        shared_x: torch.Tensor | None = None,  # [shared, hidden]
    ) -> int:
        """One-sided write of a message into world rank `peer`'s slot (region, stage): payload, then
        header, then flag. Returns the seq stamped into header and flag. Raises WindowOverflow."""
        lay = self.layout
        if header.routed_tokens > lay.routed_cap:
            raise WindowOverflow(
                f"{header.routed_tokens} routed rows do not fit routed_cap={lay.routed_cap} of the window "
                f"(world rank {peer}); raise connector_extra_config.routed_cap_multiplier"
            )
        if header.shared_tokens > lay.shared_cap or header.num_tokens > lay.token_cap:
            raise WindowOverflow(
                f"{header.num_tokens} tokens ({header.shared_tokens} shared rows) exceed token_cap="
                f"{lay.token_cap} (shared_cap={lay.shared_cap}); raise max_num_batched_tokens"
            )
        index = self.geometry.slot_index(region, stage)
        self._seq += 1
        header = dataclasses.replace(header, seq=self._seq, stage=stage)
        window = self.heap.peer_view(peer)
        dst = self._slot_views(window, index)
        for name, src, count in (
            ("route_table", route_table, header.routed_tokens),
            ("routed_x", routed_x, header.routed_tokens),
            ("shared_idx", shared_idx, header.shared_tokens),
            ("shared_x", shared_x, header.shared_tokens),
        ):
            if src is None:
                continue
            if src.shape[0] != count:
                raise ValueError(f"{name} has {src.shape[0]} rows but the header says {count}")
            getattr(dst, name)[:count].copy_(src, non_blocking=True)
        header_stage, flag_stage = self._staging_for(peer, stage)
        header_stage.copy_(torch.tensor(encode_header(header, lay.experts_per_rank), dtype=torch.int32))
        dst.header.copy_(header_stage, non_blocking=True)
        flag_stage.fill_(header.seq)
        if peer not in self._peer_flags:
            self._peer_flags[peer] = self._flag_view(window)
        self._peer_flags[peer][index : index + 1].copy_(flag_stage, non_blocking=True)
        return header.seq

    def _staging_for(self, peer: int, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source buffers of the async header/flag copies, one pair per (peer, ring slot): a shared
        staging buffer was overwritten by the next send while its copy was in flight (prior art)."""
        key = (peer, stage)
        if key not in self._staging:
            pin = self._is_cuda
            self._staging[key] = (
                torch.zeros(HEADER_WORDS + self.layout.experts_per_rank, dtype=torch.int32, pin_memory=pin),
                torch.zeros(1, dtype=torch.int64, pin_memory=pin),
            )
        return self._staging[key]

    # -- receive -------------------------------------------------------------------------------

    def _read_flags(self) -> list[int]:
        if self._poll_stream is None:
            return self._flags.tolist()
        with torch.cuda.stream(self._poll_stream):
            self._host_flags.copy_(self._flags, non_blocking=True)
            self._poll_stream.synchronize()
        return self._host_flags.tolist()

    def _read_header(self, views: SlotViews) -> list[int]:
        if self._poll_stream is None:
            return views.header.tolist()
        with torch.cuda.stream(self._poll_stream):
            self._host_header.copy_(views.header, non_blocking=True)
            self._poll_stream.synchronize()
        return self._host_header.tolist()

    @torch.inference_mode()
    def poll(
        self,
        timeout_s: float,
        *,
        regions: set[int] | None = None,
        expect_echo: Mapping[int, int] | None = None,
    ) -> Message | None:
        """Wait up to `timeout_s` for a slot whose flag changed; None on timeout.

        regions: only these sender regions (default all). expect_echo: region → seq that a
        response from that region must echo (attention side).
        """
        n = self.geometry.num_slots
        depth = self.geometry.ring_depth
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            flags = self._read_flags()
            for i in range(n):
                idx = (self._scan + i) % n
                if flags[idx] == self._seen[idx]:
                    continue
                region, stage = divmod(idx, depth)
                if regions is not None and region not in regions:
                    continue
                self._scan = (idx + 1) % n
                self._seen[idx] = flags[idx]
                return self._message(region, stage, idx, flags[idx], expect_echo)
            if time.monotonic() >= deadline:
                return None
            # spin briefly, then sleep: ranks may share few cores; at most 200 us between flag reads
            spins += 1
            if spins > 10:
                time.sleep(min(2e-4, 2e-5 * (spins - 10)))

    def _message(self, region: int, stage: int, idx: int, flag: int, expect_echo: Mapping[int, int] | None) -> Message:
        views = self._local_slots[idx]
        header = decode_header(
            self._read_header(views),
            self.layout.experts_per_rank,
            expect_seq=flag,
            expect_echo_seq=None if expect_echo is None else expect_echo.get(region),
        )
        lay = self.layout
        if header.routed_tokens > lay.routed_cap or header.shared_tokens > lay.shared_cap:
            raise WindowProtocolError(
                f"message from region {region} claims {header.routed_tokens} routed / {header.shared_tokens} "
                f"shared rows, beyond the slot's {lay.routed_cap} / {lay.shared_cap}"
            )
        if not header.is_response and not header.is_shutdown and sum(header.expert_counts) != header.routed_tokens:
            raise WindowProtocolError(
                f"expert counts {header.expert_counts} do not sum to {header.routed_tokens} routed rows"
            )
        r, s = header.routed_tokens, header.shared_tokens
        return Message(
            region=region,
            stage=stage,
            header=header,
            route_table=views.route_table[:r],
            routed_x=views.routed_x[:r],
            shared_idx=views.shared_idx[:s],
            shared_x=views.shared_x[:s],
        )

    def close(self) -> None:
        """Drop views and close the heap; never blocks."""
        self._local_slots = []
        self._peer_flags.clear()
        self.heap.close()
