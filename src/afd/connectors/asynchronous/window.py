"""The `async` connector's window I/O: one-sided write of a slot, shutdown flag, poll.

    window = [ flag[num_regions * ring_depth] int64 | shutdown[num_regions] int64 | slot(0,0) | ... ]
    slot   = [ header | rows | topk_ids | topk_weights ]   every field 256 B aligned   (asynchronous.wire)

A sender writes only region == its own role rank of the receiver's window, so every offset is
computed locally and no remote atomics are needed. Dispatch (A→F) and combine (F→A) share one
slot layout. Write order: payload, header, then the flag (the sender's monotonically increasing
int64 seq; a reply carries its request's seq instead; the header keeps its low 32 bits) — same
stream on GPU, program order on CPU. On NVSHMEM a receiver that knows the seq it expects (the
attention side waiting for replies) waits for it on its stream (`wait_flag`), without the host. The
receiver keeps a host mirror of the flag values it has seen; `poll_many` reads every flag at once
(slots and shutdown flags) and returns every changed slot of that read (`poll`: the first one),
starting its scan after the last hit so no region starves. Shutdown has its own flag per region:
announcing it never rewrites a slot whose message the peer may be reading.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from afd.connectors.asynchronous.wire import (
    FLAG_SHUTDOWN,
    HEADER_WORDS,
    SlotHeader,
    SlotViews,
    WindowGeometry,
    WindowProtocolError,
    check_geometry,
    decode_header,
    encode_header,
)
from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, HeapFactory, SymmetricHeap

logger = logging.getLogger("afd.connectors.asynchronous.window")

BUSY_POLL_S = 0.05  # CUDA receivers poll without sleeping this long after a message
STAGING_DEPTH = 16  # header/flag source buffers per peer: how far a sender's host may run ahead of its stream
GENERATION_SEQ_BITS = 40  # a restart's seqs start at generation << 40 (2**40 messages per incarnation)


@dataclass
class Message:
    """One received slot; tensors are zero-copy views into the local window, trimmed to the counts."""

    region: int  # sender's role rank
    stage: int  # ring slot; -1 for a shutdown (it has its own flag, no slot)
    header: SlotHeader  # seq / echo_seq restored to the full values (flag, request in flight)
    rows: torch.Tensor  # [num_rows, hidden]: request rows (model dtype) or reply partial sums (reply dtype)
    topk_ids: torch.Tensor  # [num_rows, topk] int32 (a request; [0, topk] for a reply)
    topk_weights: torch.Tensor  # [num_rows, topk] fp32 (a request; [0, topk] for a reply)


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
        self._flags = self._flag_view(heap.local)  # [num_flags] int64: slot flags, then shutdown flags
        self._local_slots = [self._slot_views(heap.local, i) for i in range(n)]
        self._seen = [0] * geometry.num_flags  # host mirror of the flag values already returned
        self._scan = 0
        # this rank's send counter: every flag it writes is a new, larger int64 (never wraps in practice:
        # 2**63 messages); headers carry its low 32 bits and compare them mod 2**32. A restarted rank counts from
        # above anything its previous incarnation could have stamped, so no flag it writes equals an old one.
        self._seq = heap.generation << GENERATION_SEQ_BITS
        self._peer_flags: dict[int, torch.Tensor] = {}
        self._peer_slots: dict[tuple[int, int], SlotViews] = {}
        self._staging: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]]] = {}
        self._staging_turn: dict[int, int] = {}
        self.timeout_s = timeout_s
        self._shutdown_staging: dict[int, torch.Tensor] = {}
        pin = self._is_cuda
        self._host_flags = torch.zeros(geometry.num_flags, dtype=torch.int64, pin_memory=pin)
        self._host_header = torch.zeros(HEADER_WORDS, dtype=torch.int32, pin_memory=pin)
        self._poll_stream = torch.cuda.Stream(self.device) if self._is_cuda else None
        self._last_hit = 0.0  # when the last poll returned a message (busy polling on CUDA follows it)

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
        identity: Mapping[str, object] | None = None,
    ) -> Window:
        """Check geometry (plus `identity`: other values every rank must share, e.g. the expert count)
        with every peer, log the size, allocate the heap, zero, barrier."""
        checked = {**geometry.as_dict(), **(identity or {})}
        check_geometry(store, world_rank, world_size, checked, namespace=namespace, timeout_s=timeout_s)
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
        return window[: 8 * self.geometry.num_flags].view(torch.int64)

    def _peer_flag_view(self, peer: int, window: torch.Tensor) -> torch.Tensor:
        if peer not in self._peer_flags:
            self._peer_flags[peer] = self._flag_view(window)
        return self._peer_flags[peer]

    def _peer_slot_views(self, peer: int, window: torch.Tensor, index: int) -> SlotViews:
        """A peer slot's views, made once (slicing and viewing a slot costs tens of µs of host time per send)."""
        views = self._peer_slots.get((peer, index))
        if views is None:
            views = self._peer_slots[(peer, index)] = self._slot_views(window, index)
        return views

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
        rows: torch.Tensor | None = None,  # [num_rows, hidden]
        topk_ids: torch.Tensor | None = None,  # [num_rows, topk] (requests)
        topk_weights: torch.Tensor | None = None,  # [num_rows, topk] (requests)
        seq: int | None = None,
    ) -> int:
        """One-sided write of a message into world rank `peer`'s slot (region, stage): payload, then
        header, then flag. Returns the seq stamped into header and flag. Raises WindowOverflow before
        writing anything.

        `seq` (a reply: the request's seq) replaces this rank's own counter as the stamp: the receiver then
        knows in advance which flag value ends its wait (`wait_flag`). Every reply in one slot answers a
        newer request of the same sender, so the slot's flag still only grows.

        `rows` lands in the request view (model dtype) or, for a reply (`FLAG_RESPONSE`), the reply
        view (reply dtype); the copy converts (an FFN rank hands its fp32 sums over as they are).
        """
        lay = self.layout
        if header.is_shutdown:
            raise ValueError("a shutdown has its own flag and no slot; use write_shutdown")
        lay.check_fits(header, peer)
        payload = [("rows", rows), ("topk_ids", topk_ids), ("topk_weights", topk_weights)]
        for name, src in payload:
            if src is not None and src.shape[0] != header.num_rows:
                raise ValueError(f"{name} has {src.shape[0]} rows but the header says {header.num_rows}")
            if src is None and header.num_rows and (name == "rows" or not header.is_response):
                raise ValueError(f"a message of {header.num_rows} rows needs its {name}")
        index = self.geometry.slot_index(region, stage)
        header = dataclasses.replace(header, seq=self._seq + 1 if seq is None else seq, stage=stage)
        words = encode_header(header)  # a bad header raises here, before any byte is written
        if seq is None:
            self._seq += 1
        window = self.heap.peer_view(peer)
        dst = self._peer_slot_views(peer, window, index)
        n = header.num_rows
        if rows is not None:
            (dst.out if header.is_response else dst.x)[:n].copy_(rows, non_blocking=True)
        if topk_ids is not None:
            dst.topk_ids[:n].copy_(topk_ids, non_blocking=True)
        if topk_weights is not None:
            dst.topk_weights[:n].copy_(topk_weights, non_blocking=True)
        header_stage, flag_stage, sent = self._staging_for(peer)
        header_stage.numpy()[:] = words  # host memory: written in place, no tensor made per send
        dst.header.copy_(header_stage, non_blocking=True)
        flag_stage.numpy()[0] = header.seq
        self._peer_flag_view(peer, window)[index : index + 1].copy_(flag_stage, non_blocking=True)
        if sent is not None:
            sent.record()
        return header.seq

    @torch.inference_mode()
    def write_shutdown(self, peer: int, region: int) -> int:
        """Raise `region`'s shutdown flag in world rank `peer`'s window (a new seq); touches no slot,
        so a message the peer is still reading stays intact. Returns the seq written."""
        index = self.geometry.shutdown_index(region)
        self._seq += 1
        window = self.heap.peer_view(peer)
        if peer not in self._shutdown_staging:
            self._shutdown_staging[peer] = torch.zeros(1, dtype=torch.int64, pin_memory=self._is_cuda)
        stage = self._shutdown_staging[peer]
        stage.fill_(self._seq)
        self._peer_flag_view(peer, window)[index : index + 1].copy_(stage, non_blocking=True)
        return self._seq

    def _staging_for(self, peer: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Source buffers of the async header/flag copies to `peer`: a ring of STAGING_DEPTH, each entry with the
        event recorded after its copies. A host that runs ahead of its stream (device-side waits) must not rewrite
        a buffer whose copy has not run yet (a shared buffer was once overwritten that way), so reusing an entry
        waits, bounded, for its event."""
        ring = self._staging.setdefault(peer, [])
        turn = self._staging_turn.get(peer, 0)
        self._staging_turn[peer] = (turn + 1) % STAGING_DEPTH
        if turn == len(ring):
            pin = self._is_cuda
            ring.append(
                (
                    torch.zeros(HEADER_WORDS, dtype=torch.int32, pin_memory=pin),
                    torch.zeros(1, dtype=torch.int64, pin_memory=pin),
                    torch.cuda.Event() if pin else None,
                )
            )
            return ring[turn]
        sent = ring[turn][2]
        if sent is not None and not sent.query():
            deadline = time.monotonic() + self.timeout_s
            while not sent.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"world rank {self.heap.world_rank} waited {self.timeout_s:.0f}s for a send to world rank "
                        f"{peer} issued {STAGING_DEPTH} sends ago to leave its stream (the peer stopped answering?)"
                    )
                time.sleep(2e-5)
        return ring[turn]

    # -- receive -------------------------------------------------------------------------------

    @property
    def device_waits(self) -> bool:
        """Whether a receiver can wait for a slot on its stream (`wait_flag`) instead of polling from the host."""
        return self.heap.device_waits

    def wait_flag(self, region: int, stage: int, seq: int, stream: torch.cuda.Stream) -> SlotViews:
        """Enqueue on `stream` a device-side wait until slot (region, stage) holds a message stamped `seq` or later;
        returns the slot's local views for the work enqueued after it. The host does not block (the world's
        heartbeat watchdog bounds a peer that never answers). The header is not checked here: the caller reads
        it back later (`local_slot(...).header`) to keep the magic/version/echo checks off the critical path."""
        idx = self.geometry.slot_index(region, stage)
        self.heap.wait_on_stream(8 * idx, seq, stream)
        return self._local_slots[idx]

    def local_slot(self, region: int, stage: int) -> SlotViews:
        return self._local_slots[self.geometry.slot_index(region, stage)]

    @property
    def seq(self) -> int:
        """The seq this rank stamped last (its next message gets a larger one)."""
        return self._seq

    def advance_seq(self, count: int) -> None:
        """`count` messages were stamped on the device (a replayed graph, asynchronous.chain_kernels.send_request)."""
        self._seq += count

    def local_flag(self, region: int, stage: int) -> torch.Tensor:
        """Slot (region, stage)'s flag in this rank's window: [1] int64."""
        idx = self.geometry.slot_index(region, stage)
        return self._flags[idx : idx + 1]

    def peer_slot(self, peer: int, region: int, stage: int) -> tuple[SlotViews, torch.Tensor]:
        """World rank `peer`'s slot (region, stage) and its flag ([1] int64): what a device-side sender writes."""
        window = self.heap.peer_view(peer)
        idx = self.geometry.slot_index(region, stage)
        return self._peer_slot_views(peer, window, idx), self._peer_flag_view(peer, window)[idx : idx + 1]

    def forget(self, region: int, stage: int) -> None:
        """Forget the flag value last seen in slot (region, stage): its next nonzero flag is a message again (the
        slot was served on the device, which resets its flag to 0; afd.connectors.asynchronous.ffn_chain)."""
        self._seen[self.geometry.slot_index(region, stage)] = 0

    def forget_peer(self, peer: int) -> None:
        """Drop the views of world rank `peer`'s window (it is about to be mapped anew: a restarted rank)."""
        self._peer_flags.pop(peer, None)
        for key in [k for k in self._peer_slots if k[0] == peer]:
            del self._peer_slots[key]
        self._staging.pop(peer, None)
        self._staging_turn.pop(peer, None)
        self._shutdown_staging.pop(peer, None)

    def reset_region(self, region: int) -> None:
        """Take what `region`'s sender left in this window as seen: a restarted sender's first message is the first
        one read from that region again (what its dead incarnation wrote is never served)."""
        flags = self._read_flags()
        for stage in range(self.geometry.ring_depth):
            idx = self.geometry.slot_index(region, stage)
            self._seen[idx] = flags[idx]
        sd = self.geometry.shutdown_index(region)
        self._seen[sd] = flags[sd]

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
        """Wait up to `timeout_s` for a slot whose flag changed, or a region's shutdown; None on timeout.
        The first message `poll_many` would return."""
        got = self.poll_many(timeout_s, 1, regions=regions, expect_echo=expect_echo)
        return got[0] if got else None

    @torch.inference_mode()
    def poll_many(
        self,
        timeout_s: float,
        max_messages: int | None = None,
        *,
        regions: set[int] | None = None,
        expect_echo: Mapping[int, int] | None = None,
        skip: set[int] | None = None,
    ) -> list[Message]:
        """Wait up to `timeout_s` until some slot's flag changed or a region shut down, then return every
        such message of that one flag read (at most `max_messages`); [] on timeout.

        regions: only these sender regions (default all). expect_echo: region → seq that a
        response from that region must echo (attention side). A region's shutdown (stage -1) comes
        first, and the messages of that region still unread are dropped: its sender is gone and
        reads nothing more. The scan of slots starts after the last hit so no region starves. skip: slot
        indices served on the device (afd.connectors.asynchronous.ffn_chain), whose flags are not messages for the host.
        """
        geom = self.geometry
        n, depth = geom.num_slots, geom.ring_depth
        limit = n + geom.num_regions if max_messages is None else max_messages
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            flags = self._read_flags()  # one read: slot flags and shutdown flags of the same instant
            out: list[Message] = []
            for region in range(geom.num_regions):
                sd = geom.shutdown_index(region)
                if len(out) < limit and flags[sd] != self._seen[sd] and (regions is None or region in regions):
                    self._seen[sd] = flags[sd]
                    for stage in range(depth):  # drop what the departed sender left unread
                        idx = geom.slot_index(region, stage)
                        self._seen[idx] = flags[idx]
                    out.append(self._shutdown_message(region, flags[sd]))
            start = self._scan
            for i in range(n):
                idx = (start + i) % n
                if len(out) >= limit:
                    break
                if flags[idx] == self._seen[idx] or (skip is not None and idx in skip):
                    continue
                region, stage = divmod(idx, depth)
                if regions is not None and region not in regions:
                    continue
                self._scan = (idx + 1) % n
                self._seen[idx] = flags[idx]
                out.append(self._message(region, stage, idx, flags[idx], expect_echo))
            now = time.monotonic()
            if out:
                self._last_hit = now
                return out
            if now >= deadline:
                return out
            # On CUDA every read is a device->host copy (~20 us) and a rank has its own cores: keep reading without
            # sleeping for BUSY_POLL_S after the last message (a decode step's next layer comes within that).
            # Otherwise spin briefly, then sleep: ranks may share few cores; at most 200 us between flag reads.
            spins += 1
            if spins > 10 and not (self._is_cuda and now - self._last_hit < BUSY_POLL_S):
                time.sleep(min(2e-4, 2e-5 * (spins - 10)))

    def _message(self, region: int, stage: int, idx: int, flag: int, expect_echo: Mapping[int, int] | None) -> Message:
        views = self._local_slots[idx]
        header = decode_header(
            self._read_header(views),
            expect_seq=flag,
            expect_echo_seq=None if expect_echo is None else expect_echo.get(region),
        )
        lay = self.layout
        if header.num_rows > lay.row_cap or header.num_tokens > lay.token_cap:
            raise WindowProtocolError(
                f"message from region {region} claims {header.num_rows} rows of {header.num_tokens} tokens, beyond "
                f"the slot's row_cap {lay.row_cap} / token_cap {lay.token_cap}"
            )
        r = header.num_rows
        if header.is_response:
            return Message(region, stage, header, views.out[:r], views.topk_ids[:0], views.topk_weights[:0])
        return Message(region, stage, header, views.x[:r], views.topk_ids[:r], views.topk_weights[:r])

    def _shutdown_message(self, region: int, flag: int) -> Message:
        views = self._local_slots[self.geometry.slot_index(region, 0)]
        header = SlotHeader(flags=FLAG_SHUTDOWN, seq=flag)
        return Message(region, -1, header, views.x[:0], views.topk_ids[:0], views.topk_weights[:0])

    def close(self) -> None:
        """Drop views and close the heap; never blocks."""
        self._local_slots = []
        self._peer_flags.clear()
        self._peer_slots.clear()
        self.heap.close()
