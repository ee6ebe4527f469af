"""The `async` connector's wire format, pure: slot layout, in-band header codec, window geometry.

    window = [ flag[num_regions * ring_depth] int64 | shutdown[num_regions] int64 | slot(0,0) | slot(0,1) | ... ]
    slot   = [ header | rows | topk_ids | topk_weights ]   every field 256 B aligned

Version 3: one row per (token, destination FFN rank). A request carries each token once to every FFN
rank that owns at least one of its experts: its hidden state (`rows` as the model dtype), its whole
top-k (`topk_ids` int32, global expert ids) and `topk_weights` (fp32); the first `shared_rows` rows
also take the shared experts there. The reply reuses the same slot layout: one weighted partial sum
per request row (`rows` as the reply dtype), so `rows` is sized for the wider of the two dtypes.
The receiver knows which token a reply row belongs to without an index table: the sender kept its
plan. Shutdown has its own flag per sender region, so announcing it never touches a slot a message
may still be in.

Sequence numbers: flags carry the sender's full int64 seq; the header carries its low 32 bits
(`seq` and `echo_seq` words, as the int32 bit pattern) and every comparison is mod 2**32, so a
counter past 2**31 or 2**32 never stops a run.

Everything here is arithmetic on sizes and int32 words, so it is tested without processes;
`afd.connectors.asynchronous.window` does the I/O.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, wait_keys

logger = logging.getLogger("afd.connectors.asynchronous.window")

MAGIC = int.from_bytes(b"AFDG", "little")
MAGIC_WORD = MAGIC - (1 << 32) if MAGIC >= 1 << 31 else MAGIC  # as the int32 a header word holds
# 1: the seed's slot with route_table/shared_idx, shutdown written into ring stage 0.
# 2: no route_table/shared_idx, a shutdown flag per region, seq words mod 2**32.
# 3: one row per (token, destination FFN rank) with its top-k ids and fp32 weights; one partial sum back.
# 4: a reply is stamped (flag and header seq) with its request's seq, not the FFN rank's own counter, so the
#    attention rank knows the flag value its stream waits for (device-side waits); the layout is version 3's.
VERSION = 4
HEADER_WORDS = 12
ALIGN = 256
FLAG_RESPONSE = 1 << 0  # FFN → attention (combine) message
FLAG_SHUTDOWN = 1 << 1  # the sender is going away; no payload
# header word indices (words 10 and 11 are spare)
W_MAGIC, W_VERSION, W_FLAGS, W_LAYER, W_NUM_TOKENS, W_ROWS, W_SHARED, W_SEQ, W_ECHO_SEQ, W_STAGE = range(10)
_INT32_MAX = 2**31 - 1
SEQ_MOD = 2**32  # the header keeps seq/echo_seq modulo this


def seq32(seq: int) -> int:
    """The low 32 bits of a sequence number (what the header carries), as an unsigned value."""
    return seq % SEQ_MOD


def seq_matches(a: int, b: int) -> bool:
    """Wrap-safe equality of two sequence numbers of which at least one may be truncated to 32 bits."""
    return seq32(a) == seq32(b)


def _seq_word(seq: int) -> int:
    """Low 32 bits of `seq` as the int32 bit pattern stored in a header word."""
    low = seq32(seq)
    return low - SEQ_MOD if low > _INT32_MAX else low


class WindowProtocolError(RuntimeError):
    """A slot's content breaks the protocol (bad magic, version, echo_seq, counts)."""


class WindowOverflow(ValueError):
    """A message does not fit the slot capacity; raised at write time, never truncated."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def reply_dtype_for(dtype: torch.dtype, num_ffn: int, *, shared_on_attention: bool = False) -> torch.dtype:
    """dtype of the partial sums FFN ranks send back: the model dtype when one FFN rank holds every
    expert and the shared experts (its partial is the whole answer, rounded once either way), else fp32
    so that adding the partials of several ranks, or the attention rank's shared experts, rounds once, as
    the reference does."""
    return dtype if num_ffn == 1 and not shared_on_attention else torch.float32


# ---------------------------------------------------------------------------------------------
# header


@dataclass(frozen=True)
class SlotHeader:
    """The 12 int32 words of one message.

    num_rows: rows in the message (request: tokens sent to this FFN rank; reply: the same count).
    shared_rows: the leading rows whose shared experts this FFN rank computes.
    """

    layer_idx: int = 0
    num_tokens: int = 0
    num_rows: int = 0
    shared_rows: int = 0
    seq: int = 0
    echo_seq: int = 0
    stage: int = 0
    flags: int = 0

    @property
    def is_shutdown(self) -> bool:
        return bool(self.flags & FLAG_SHUTDOWN)

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)


def encode_header(header: SlotHeader) -> list[int]:
    """Header → `HEADER_WORDS` int32 words; seq/echo_seq keep their low 32 bits (int32 pattern)."""
    if header.seq < 0 or header.echo_seq < 0:
        raise ValueError(f"sequence numbers are non-negative, got seq {header.seq}, echo_seq {header.echo_seq}")
    if header.shared_rows > header.num_rows:
        raise ValueError(f"{header.shared_rows} shared rows but only {header.num_rows} rows")
    words = [0] * HEADER_WORDS
    words[W_MAGIC] = MAGIC
    words[W_VERSION] = VERSION
    words[W_FLAGS] = header.flags
    words[W_LAYER] = header.layer_idx
    words[W_NUM_TOKENS] = header.num_tokens
    words[W_ROWS] = header.num_rows
    words[W_SHARED] = header.shared_rows
    words[W_STAGE] = header.stage
    if any(not 0 <= w <= _INT32_MAX for w in words[1:]):
        raise ValueError(f"header words must be non-negative int32, got {words}")
    words[W_SEQ] = _seq_word(header.seq)
    words[W_ECHO_SEQ] = _seq_word(header.echo_seq)
    return words


def decode_header(
    words: list[int],
    *,
    expect_seq: int | None = None,
    expect_echo_seq: int | None = None,
) -> SlotHeader:
    """Words → header; raises WindowProtocolError on bad magic, version, counts, seq or echo_seq.

    The header holds only the low 32 bits of seq/echo_seq: they are compared with `expect_seq` /
    `expect_echo_seq` mod 2**32, and a match restores the full value (the flag's, the request's);
    without an expectation the field is the unsigned low 32 bits.
    """
    if len(words) < HEADER_WORDS:
        raise WindowProtocolError(f"header has {len(words)} words, expected {HEADER_WORDS}")
    if words[W_MAGIC] != MAGIC:
        raise WindowProtocolError(f"bad slot magic {words[W_MAGIC]:#x} (expected {MAGIC:#x} 'AFDG')")
    if words[W_VERSION] != VERSION:
        raise WindowProtocolError(f"window protocol version {words[W_VERSION]}, this build speaks {VERSION}")
    header = SlotHeader(
        layer_idx=words[W_LAYER],
        num_tokens=words[W_NUM_TOKENS],
        num_rows=words[W_ROWS],
        shared_rows=words[W_SHARED],
        seq=seq32(words[W_SEQ]),
        echo_seq=seq32(words[W_ECHO_SEQ]),
        stage=words[W_STAGE],
        flags=words[W_FLAGS],
    )
    if not 0 <= header.shared_rows <= header.num_rows:
        raise WindowProtocolError(f"header claims {header.shared_rows} shared rows of {header.num_rows} rows")
    if expect_seq is not None:
        if not seq_matches(header.seq, expect_seq):
            raise WindowProtocolError(
                f"header seq {header.seq} does not match its flag {expect_seq} (mod 2**32: {seq32(expect_seq)})"
            )
        header = dataclasses.replace(header, seq=expect_seq)
    if expect_echo_seq is not None and not header.is_shutdown:
        if not seq_matches(header.echo_seq, expect_echo_seq):
            raise WindowProtocolError(
                f"response echoes seq {header.echo_seq} but the request in flight had seq {expect_echo_seq} "
                f"(mod 2**32: {seq32(expect_echo_seq)})"
            )
        header = dataclasses.replace(header, echo_seq=expect_echo_seq)
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
    """Typed views of one slot (local or a peer's); `x` and `out` alias the same `rows` bytes."""

    header: torch.Tensor  # [HEADER_WORDS] int32
    x: torch.Tensor  # [row_cap, hidden] model dtype: request rows
    out: torch.Tensor  # [row_cap, hidden] reply dtype: reply rows (weighted partial sums)
    topk_ids: torch.Tensor  # [row_cap, topk] int32: global expert ids of each request row
    topk_weights: torch.Tensor  # [row_cap, topk] fp32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one slot; identical on every rank (checked through the store)."""

    hidden_size: int
    dtype: torch.dtype  # request rows (the model dtype)
    reply_dtype: torch.dtype  # reply rows (`reply_dtype_for`)
    topk: int
    token_cap: int
    row_cap: int

    @classmethod
    def for_model(
        cls,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        topk: int,
        num_ffn: int,
        max_num_batched_tokens: int,
        routed_cap_multiplier: float = 2.0,
        shared_on_attention: bool = False,
    ) -> SlotLayout:
        """token_cap = max_num_batched_tokens; row_cap = ceil(token_cap * min(topk, F) / F) * multiplier,
        capped at token_cap (a token travels at most once to each FFN rank, so token_cap always fits)."""
        token_cap = max_num_batched_tokens
        even = -(-token_cap * min(topk, num_ffn) // num_ffn)
        row_cap = min(int(-(-even * routed_cap_multiplier // 1)), token_cap)
        return cls(
            hidden_size=hidden_size,
            dtype=dtype,
            reply_dtype=reply_dtype_for(dtype, num_ffn, shared_on_attention=shared_on_attention),
            topk=topk,
            token_cap=token_cap,
            row_cap=max(row_cap, 1),
        )

    @cached_property
    def fields(self) -> dict[str, Field]:
        widest = max(_itemsize(self.dtype), _itemsize(self.reply_dtype))
        rows, k = self.row_cap, self.topk
        specs = [
            ("header", torch.int32, (HEADER_WORDS,)),
            ("rows", torch.uint8, (rows * self.hidden_size * widest,)),
            ("topk_ids", torch.int32, (rows, k)),
            ("topk_weights", torch.float32, (rows, k)),
        ]
        out: dict[str, Field] = {}
        offset = 0
        for name, dtype, shape in specs:
            size = _itemsize(dtype)
            for d in shape:
                size *= d
            out[name] = Field(name, offset, _align(size), dtype, shape)
            offset += _align(size)
        return out

    @property
    def slot_bytes(self) -> int:
        last = list(self.fields.values())[-1]
        return last.offset + last.nbytes

    def request_row_bytes(self) -> int:
        """Bytes one request row moves: its hidden state, top-k ids and weights."""
        return self.hidden_size * _itemsize(self.dtype) + 8 * self.topk

    def reply_row_bytes(self) -> int:
        return self.hidden_size * _itemsize(self.reply_dtype)

    def views(self, slot: torch.Tensor) -> SlotViews:
        """slot: [slot_bytes] uint8 → typed views (no copy)."""

        def raw(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            f = self.fields[name]
            numel = 1
            for d in shape:
                numel *= d
            return slot[f.offset : f.offset + f.nbytes].view(dtype)[:numel].view(shape)

        rows = (self.row_cap, self.hidden_size)
        return SlotViews(
            header=raw("header", torch.int32, (HEADER_WORDS,)),
            x=raw("rows", self.dtype, rows),
            out=raw("rows", self.reply_dtype, rows),
            topk_ids=raw("topk_ids", torch.int32, (self.row_cap, self.topk)),
            topk_weights=raw("topk_weights", torch.float32, (self.row_cap, self.topk)),
        )

    def describe(self) -> str:
        return ", ".join(f"{f.name} {f.nbytes}" for f in self.fields.values())

    def check_fits(self, header: SlotHeader, peer: int) -> None:
        """Raise WindowOverflow if the message of `header` does not fit a slot (checked before any
        slot is reserved or written, so an overflow leaves nothing half sent)."""
        if header.num_tokens > self.token_cap:
            raise WindowOverflow(
                f"{header.num_tokens} tokens exceed token_cap={self.token_cap} of the window (world rank {peer}); "
                "raise max_num_batched_tokens"
            )
        if header.num_rows > self.row_cap:
            raise WindowOverflow(
                f"{header.num_rows} rows do not fit row_cap={self.row_cap} of the window (world rank {peer}); "
                "raise connector_extra_config.routed_cap_multiplier"
            )


@dataclass(frozen=True)
class WindowGeometry:
    """Where each (region, stage) slot and each flag sits in a window.

    The flag area is `num_slots` message flags (index `region * ring_depth + stage`) followed by
    `num_regions` shutdown flags (index `num_slots + region`): one read of `num_flags` int64 sees both.
    """

    layout: SlotLayout
    num_regions: int
    ring_depth: int

    @property
    def num_slots(self) -> int:
        return self.num_regions * self.ring_depth

    @property
    def num_flags(self) -> int:
        return self.num_slots + self.num_regions

    def shutdown_index(self, region: int) -> int:
        """Index of `region`'s shutdown flag in the flag area."""
        if not 0 <= region < self.num_regions:
            raise IndexError(f"region {region} outside 0..{self.num_regions - 1}")
        return self.num_slots + region

    @property
    def flags_bytes(self) -> int:
        return _align(8 * self.num_flags)

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
            "reply_dtype": str(lay.reply_dtype).removeprefix("torch."),
            "topk": lay.topk,
            "token_cap": lay.token_cap,
            "row_cap": lay.row_cap,
            "slot_bytes": lay.slot_bytes,
            "window_bytes": self.nbytes,
        }

    def describe(self) -> str:
        return (
            f"{self.nbytes} bytes ({self.nbytes / 2**20:.1f} MiB) = flags {self.flags_bytes} + "
            f"{self.num_regions} regions x {self.ring_depth} ring x slot {self.layout.slot_bytes} "
            f"({self.layout.describe()}; token_cap {self.layout.token_cap}, row_cap {self.layout.row_cap}, "
            f"replies in {str(self.layout.reply_dtype).removeprefix('torch.')})"
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
            if name == "version" and theirs.get(name) != value:
                raise ValueError(
                    f"window protocol version {value} on world rank {world_rank} but {theirs.get(name)} on "
                    f"world rank {r}; run the same afd build on every rank"
                )
            if theirs.get(name) != value:
                raise ValueError(
                    f"window geometry differs: {name}={value} on world rank {world_rank} but "
                    f"{theirs.get(name)} on world rank {r}; start every rank with the same model, "
                    "max_num_batched_tokens and connector_extra_config"
                )
