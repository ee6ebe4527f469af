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
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, HeapFactory, SymmetricHeap, wait_keys

logger = logging.getLogger("afd.connectors.window")

MAGIC = int.from_bytes(b"AFDG", "little")
VERSION = 1
HEADER_WORDS = 12
ALIGN = 256
FLAG_RESPONSE = 1 << 0  # FFN → attention (combine) message
FLAG_SHUTDOWN = 1 << 1  # the sender is going away; no payload
# header word indices
W_MAGIC, W_VERSION, W_FLAGS, W_LAYER, W_NUM_TOKENS, W_ROUTED, W_SHARED, W_SEQ, W_ECHO_SEQ, W_STAGE = range(10)
_INT32_MAX = 2**31 - 1


class WindowProtocolError(RuntimeError):
    """A slot's content breaks the protocol (bad magic, version, echo_seq, counts)."""


class WindowOverflow(ValueError):
    """A message does not fit the slot capacity; raised at write time, never truncated."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------------------------
# header


@dataclass(frozen=True)
class SlotHeader:
    """The 12 fixed int32 words plus `expert_counts[experts_per_rank]` of one message."""

    layer_idx: int = 0
    num_tokens: int = 0
    routed_tokens: int = 0
    shared_tokens: int = 0
    seq: int = 0
    echo_seq: int = 0
    stage: int = 0
    flags: int = 0
    expert_counts: tuple[int, ...] = ()

    @property
    def is_shutdown(self) -> bool:
        return bool(self.flags & FLAG_SHUTDOWN)

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)


def encode_header(header: SlotHeader, experts_per_rank: int) -> list[int]:
    """Header → `12 + experts_per_rank` int32 words."""
    if len(header.expert_counts) > experts_per_rank:
        raise ValueError(f"{len(header.expert_counts)} expert counts do not fit a header of {experts_per_rank}")
    words = [0] * (HEADER_WORDS + experts_per_rank)
    words[W_MAGIC] = MAGIC
    words[W_VERSION] = VERSION
    words[W_FLAGS] = header.flags
    words[W_LAYER] = header.layer_idx
    words[W_NUM_TOKENS] = header.num_tokens
    words[W_ROUTED] = header.routed_tokens
    words[W_SHARED] = header.shared_tokens
    words[W_SEQ] = header.seq
    words[W_ECHO_SEQ] = header.echo_seq
    words[W_STAGE] = header.stage
    words[HEADER_WORDS : HEADER_WORDS + len(header.expert_counts)] = header.expert_counts
    if any(not 0 <= w <= _INT32_MAX for w in words[1:]):
        raise ValueError(f"header words must be non-negative int32, got {words}")
    return words


def decode_header(
    words: list[int],
    experts_per_rank: int,
    *,
    expect_seq: int | None = None,
    expect_echo_seq: int | None = None,
) -> SlotHeader:
    """Words → header; raises WindowProtocolError on bad magic, version, seq or echo_seq."""
    if len(words) < HEADER_WORDS + experts_per_rank:
        raise WindowProtocolError(f"header has {len(words)} words, expected {HEADER_WORDS + experts_per_rank}")
    if words[W_MAGIC] != MAGIC:
        raise WindowProtocolError(f"bad slot magic {words[W_MAGIC]:#x} (expected {MAGIC:#x} 'AFDG')")
    if words[W_VERSION] != VERSION:
        raise WindowProtocolError(f"window protocol version {words[W_VERSION]}, this build speaks {VERSION}")
    header = SlotHeader(
        layer_idx=words[W_LAYER],
        num_tokens=words[W_NUM_TOKENS],
        routed_tokens=words[W_ROUTED],
        shared_tokens=words[W_SHARED],
        seq=words[W_SEQ],
        echo_seq=words[W_ECHO_SEQ],
        stage=words[W_STAGE],
        flags=words[W_FLAGS],
        expert_counts=tuple(words[HEADER_WORDS : HEADER_WORDS + experts_per_rank]),
    )
    if expect_seq is not None and header.seq != expect_seq:
        raise WindowProtocolError(f"header seq {header.seq} does not match its flag {expect_seq}")
    if expect_echo_seq is not None and not header.is_shutdown and header.echo_seq != expect_echo_seq:
        raise WindowProtocolError(
            f"response echoes seq {header.echo_seq} but the request in flight had seq {expect_echo_seq}"
        )
    return header


# ---------------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class Field:
    name: str
    offset: int  # bytes from the slot start, multiple of ALIGN
    nbytes: int  # aligned size
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class SlotViews:
    """Typed views of one slot (local or a peer's)."""

    header: torch.Tensor  # [12 + experts_per_rank] int32
    route_table: torch.Tensor  # [routed_cap] int32: token index of each routed row
    routed_x: torch.Tensor  # [routed_cap, hidden] dtype
    shared_idx: torch.Tensor  # [shared_cap] int32: token index of each shared row
    shared_x: torch.Tensor  # [shared_cap, hidden] dtype


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one slot; identical on every rank (checked through the store)."""

    hidden_size: int
    dtype: torch.dtype
    experts_per_rank: int
    token_cap: int
    routed_cap: int
    shared_cap: int

    @classmethod
    def for_model(
        cls,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        topk: int,
        num_ffn: int,
        experts_per_rank: int,
        max_num_batched_tokens: int,
        routed_cap_multiplier: float = 2.0,
    ) -> SlotLayout:
        """token_cap = max_num_batched_tokens; routed_cap = ceil(token_cap*topk/F) * multiplier
        (capped at the worst case token_cap*topk); shared_cap = ceil(token_cap/F) (round robin)."""
        token_cap = max_num_batched_tokens
        even = -(-token_cap * topk // num_ffn)
        routed_cap = min(int(-(-even * routed_cap_multiplier // 1)), token_cap * topk)
        return cls(
            hidden_size=hidden_size,
            dtype=dtype,
            experts_per_rank=experts_per_rank,
            token_cap=token_cap,
            routed_cap=max(routed_cap, 1),
            shared_cap=-(-token_cap // num_ffn),
        )

    @cached_property
    def fields(self) -> dict[str, Field]:
        elem = torch.empty((), dtype=self.dtype).element_size()
        specs = [
            ("header", torch.int32, (HEADER_WORDS + self.experts_per_rank,)),
            ("route_table", torch.int32, (self.routed_cap,)),
            ("routed_x", self.dtype, (self.routed_cap, self.hidden_size)),
            ("shared_idx", torch.int32, (self.shared_cap,)),
            ("shared_x", self.dtype, (self.shared_cap, self.hidden_size)),
        ]
        out: dict[str, Field] = {}
        offset = 0
        for name, dtype, shape in specs:
            size = 4 if dtype == torch.int32 else elem
            for d in shape:
                size *= d
            out[name] = Field(name, offset, _align(size), dtype, shape)
            offset += _align(size)
        return out

    @property
    def slot_bytes(self) -> int:
        last = list(self.fields.values())[-1]
        return last.offset + last.nbytes

    def views(self, slot: torch.Tensor) -> SlotViews:
        """slot: [slot_bytes] uint8 → typed views (no copy)."""

        def view(f: Field) -> torch.Tensor:
            numel = 1
            for d in f.shape:
                numel *= d
            raw = slot[f.offset : f.offset + f.nbytes].view(f.dtype)
            return raw[:numel].view(f.shape)

        return SlotViews(**{name: view(f) for name, f in self.fields.items()})

    def describe(self) -> str:
        return ", ".join(f"{f.name} {f.nbytes}" for f in self.fields.values())


@dataclass(frozen=True)
class WindowGeometry:
    """Where each (region, stage) slot sits in a window."""

    layout: SlotLayout
    num_regions: int
    ring_depth: int

    @property
    def num_slots(self) -> int:
        return self.num_regions * self.ring_depth

    @property
    def flags_bytes(self) -> int:
        return _align(8 * self.num_slots)

    @property
    def nbytes(self) -> int:
        return self.flags_bytes + self.num_slots * self.layout.slot_bytes

    def slot_index(self, region: int, stage: int) -> int:
        if not (0 <= region < self.num_regions and 0 <= stage < self.ring_depth):
            raise IndexError(f"slot (region {region}, stage {stage}) outside {self.num_regions}x{self.ring_depth}")
        return region * self.ring_depth + stage

    def slot_offset(self, region: int, stage: int) -> int:
        return self.flags_bytes + self.slot_index(region, stage) * self.layout.slot_bytes

    def as_dict(self) -> dict[str, object]:
        lay = self.layout
        return {
            "version": VERSION,
            "num_regions": self.num_regions,
            "ring_depth": self.ring_depth,
            "hidden_size": lay.hidden_size,
            "dtype": str(lay.dtype).removeprefix("torch."),
            "experts_per_rank": lay.experts_per_rank,
            "token_cap": lay.token_cap,
            "routed_cap": lay.routed_cap,
            "shared_cap": lay.shared_cap,
            "slot_bytes": lay.slot_bytes,
            "window_bytes": self.nbytes,
        }

    def describe(self) -> str:
        return (
            f"{self.nbytes} bytes ({self.nbytes / 2**20:.1f} MiB) = flags {self.flags_bytes} + "
            f"{self.num_regions} regions x {self.ring_depth} ring x slot {self.layout.slot_bytes} "
            f"({self.layout.describe()}; token_cap {self.layout.token_cap}, routed_cap "
            f"{self.layout.routed_cap}, shared_cap {self.layout.shared_cap})"
        )


def check_geometry(
    store: dist.Store,
    world_rank: int,
    world_size: int,
    geometry: Mapping[str, object],
    *,
    namespace: str = "afd_async",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Publish this rank's geometry and compare every peer's; a mismatch names the parameter."""
    store.set(f"{namespace}/geometry/{world_rank}", json.dumps(dict(geometry)))
    keys = [f"{namespace}/geometry/{r}" for r in range(world_size)]
    wait_keys(store, keys, timeout_s, f"window geometry of all {world_size} ranks")
    for r, key in enumerate(keys):
        theirs = json.loads(store.get(key))
        for name, value in geometry.items():
            if theirs.get(name) != value:
                raise ValueError(
                    f"window geometry differs: {name}={value} on world rank {world_rank} but "
                    f"{theirs.get(name)} on world rank {r}; start every rank with the same model, "
                    "max_num_batched_tokens and connector_extra_config"
                )


# ---------------------------------------------------------------------------------------------
# the window


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
