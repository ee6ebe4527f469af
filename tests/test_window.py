"""Slot layout, header and one-sided window protocol of the `async` connector (single process)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

import pytest
import torch
import torch.distributed as dist

from afd.connectors.window import Window
from afd.connectors.wire import (
    ALIGN,
    FLAG_RESPONSE,
    FLAG_SHUTDOWN,
    HEADER_WORDS,
    MAGIC,
    VERSION,
    W_ECHO_SEQ,
    W_SEQ,
    SlotHeader,
    SlotLayout,
    WindowGeometry,
    WindowOverflow,
    WindowProtocolError,
    check_geometry,
    decode_header,
    encode_header,
    seq_matches,
)
from afd.transport.symm_heap import SymmetricHeap


class LoopbackHeap(SymmetricHeap):
    """All ranks' windows in one process (plain tensors); barrier is a no-op."""

    def __init__(self, windows: dict[int, torch.Tensor], world_rank: int) -> None:
        super().__init__(dist.HashStore(), world_rank, len(windows), windows[world_rank].numel())
        self.windows = windows
        self.local = windows[world_rank]

    def peer_view(self, world_rank: int) -> torch.Tensor:
        return self.windows[world_rank]

    def barrier(self, tag: str, timeout_s: float = 1.0) -> None:
        pass

    def close(self) -> None:
        pass


def make_layout(hidden: int = 24, dtype: torch.dtype = torch.bfloat16, per_rank: int = 3) -> SlotLayout:
    return SlotLayout.for_model(
        hidden_size=hidden, dtype=dtype, topk=2, num_ffn=2, experts_per_rank=per_rank, max_num_batched_tokens=10
    )


def make_pair(geometry: WindowGeometry) -> tuple[Window, Window]:
    windows = {r: torch.full((geometry.nbytes,), 7, dtype=torch.uint8) for r in range(2)}  # garbage before zeroing
    return Window(LoopbackHeap(windows, 0), geometry), Window(LoopbackHeap(windows, 1), geometry)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [1, 7, 64])
def test_slot_fields_disjoint_aligned_in_bounds(dtype: torch.dtype, hidden: int) -> None:
    layout = make_layout(hidden, dtype)
    fields = list(layout.fields.values())
    assert [f.name for f in fields] == ["header", "routed_x", "shared_x"]
    elem = torch.empty((), dtype=f.dtype).element_size() if (f := fields[1]) else 0
    for f in fields:
        assert f.offset % ALIGN == 0 and f.nbytes % ALIGN == 0
        numel = 1
        for d in f.shape:
            numel *= d
        assert numel * (4 if f.dtype == torch.int32 else elem) <= f.nbytes
    for a, b in zip(fields, fields[1:], strict=False):
        assert a.offset + a.nbytes <= b.offset
    assert fields[-1].offset + fields[-1].nbytes == layout.slot_bytes
    assert layout.slot_bytes % ALIGN == 0


def test_every_offset_viewable_under_its_dtype() -> None:
    layout = make_layout(hidden=5, dtype=torch.float16)
    geom = WindowGeometry(layout, num_regions=3, ring_depth=2)
    window = torch.zeros(geom.nbytes, dtype=torch.uint8)
    base = window.data_ptr()
    owner = torch.zeros(geom.nbytes, dtype=torch.int32)  # how many fields claim each byte
    owner[: 8 * geom.num_flags] += 1  # slot flags and shutdown flags
    assert geom.num_flags == 3 * 2 + 3 and geom.shutdown_index(2) == 8
    assert geom.flags_bytes % ALIGN == 0 and geom.flags_bytes >= 8 * geom.num_flags
    for region in range(3):
        for stage in range(2):
            off = geom.slot_offset(region, stage)
            assert off % ALIGN == 0 and off + layout.slot_bytes <= geom.nbytes
            views = layout.views(window[off : off + layout.slot_bytes])
            for f in layout.fields.values():
                v = getattr(views, f.name)
                assert v.dtype == f.dtype and tuple(v.shape) == f.shape
                assert v.data_ptr() - base == off + f.offset
                v.fill_(1)  # writable under its dtype
                owner[off + f.offset : off + f.offset + v.numel() * v.element_size()] += 1
    assert int(owner.max()) == 1
    with pytest.raises(IndexError):
        geom.slot_offset(3, 0)


def test_capacities_follow_design() -> None:
    layout = SlotLayout.for_model(
        hidden_size=8, dtype=torch.float32, topk=6, num_ffn=4, experts_per_rank=16, max_num_batched_tokens=100
    )
    assert layout.token_cap == 100
    assert layout.routed_cap == 150 * 2  # ceil(100*6/4) * 2.0
    assert layout.shared_cap == 25
    capped = SlotLayout.for_model(
        hidden_size=8,
        dtype=torch.float32,
        topk=2,
        num_ffn=2,
        experts_per_rank=1,
        max_num_batched_tokens=10,
        routed_cap_multiplier=5.0,
    )
    assert capped.routed_cap == 20  # never more than every partial on one rank


def test_header_round_trip_and_checks() -> None:
    h = SlotHeader(
        layer_idx=3,
        num_tokens=9,
        routed_tokens=5,
        shared_tokens=4,
        seq=11,
        echo_seq=7,
        stage=1,
        expert_counts=(2, 0, 3),
    )
    words = encode_header(h, 4)
    assert len(words) == HEADER_WORDS + 4 and words[0] == MAGIC and words[1] == VERSION
    assert int.from_bytes(torch.tensor(words[:1], dtype=torch.int32).numpy().tobytes(), "little") == MAGIC
    assert torch.tensor(words[:1], dtype=torch.int32).numpy().tobytes() == b"AFDG"
    back = decode_header(words, 4, expect_seq=11, expect_echo_seq=7)
    assert back == SlotHeader(**{**h.__dict__, "expert_counts": (2, 0, 3, 0)})
    with pytest.raises(WindowProtocolError, match="magic"):
        decode_header([0, *words[1:]], 4)
    with pytest.raises(WindowProtocolError, match="version"):
        decode_header([words[0], VERSION + 1, *words[2:]], 4)
    with pytest.raises(WindowProtocolError, match="echo"):
        decode_header(words, 4, expect_echo_seq=8)
    with pytest.raises(WindowProtocolError, match="seq"):
        decode_header(words, 4, expect_seq=12)
    with pytest.raises(ValueError):
        encode_header(SlotHeader(expert_counts=(1, 2, 3)), 2)


def test_shutdown_bit() -> None:
    words = encode_header(SlotHeader(flags=FLAG_SHUTDOWN | FLAG_RESPONSE), 2)
    assert words[2] & (1 << 1)
    h = decode_header(words, 2, expect_echo_seq=99)  # a shutdown answers nothing: no echo check
    assert h.is_shutdown and h.is_response
    assert not decode_header(encode_header(SlotHeader(), 2), 2).is_shutdown


def test_write_then_poll_zero_copy() -> None:
    geom = WindowGeometry(make_layout(hidden=4, dtype=torch.float32), num_regions=2, ring_depth=1)
    sender, receiver = make_pair(geom)
    assert int(receiver.heap.local.sum()) == 0  # zeroed at init
    assert receiver.poll(0.0) is None
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    header = SlotHeader(layer_idx=2, num_tokens=3, routed_tokens=3, shared_tokens=2, expert_counts=(1, 2, 0))
    seq = sender.write_slot(1, region=1, stage=0, header=header, routed_x=x, shared_x=x[:2] * 10)
    msg = receiver.poll(1.0)
    assert msg is not None and msg.region == 1 and msg.stage == 0
    assert msg.header.seq == seq and msg.header.layer_idx == 2 and msg.header.expert_counts == (1, 2, 0)
    torch.testing.assert_close(msg.routed_x, x)
    torch.testing.assert_close(msg.shared_x, x[:2] * 10)
    local = receiver.heap.local
    assert local.data_ptr() <= msg.routed_x.data_ptr() < local.data_ptr() + local.numel()  # a view, no copy
    assert receiver.poll(0.0) is None  # seen mirror: no second delivery


def test_overflow_raises_and_publishes_nothing() -> None:
    layout = make_layout(hidden=4, dtype=torch.float32)
    sender, receiver = make_pair(WindowGeometry(layout, 2, 1))
    n = layout.routed_cap + 1
    with pytest.raises(WindowOverflow, match="routed_cap"):
        sender.write_slot(1, 0, 0, SlotHeader(routed_tokens=n, expert_counts=(n,)), routed_x=torch.zeros(n, 4))
    s = layout.shared_cap + 1
    with pytest.raises(WindowOverflow, match="token_cap"):
        sender.write_slot(1, 0, 0, SlotHeader(shared_tokens=s), shared_x=torch.zeros(s, 4))
    assert receiver.poll(0.0) is None


def test_poll_rotates_scan_start() -> None:
    geom = WindowGeometry(make_layout(hidden=2, dtype=torch.float32), num_regions=2, ring_depth=1)
    sender, receiver = make_pair(geom)
    for region in (0, 1):
        sender.write_slot(1, region, 0, SlotHeader())
    assert receiver.poll(0.0).region == 0
    sender.write_slot(1, 0, 0, SlotHeader())  # region 0 is ready again, but region 1 waited longer
    assert receiver.poll(0.0).region == 1
    assert receiver.poll(0.0).region == 0
    assert receiver.poll(0.0) is None


def test_window_size_logged_and_geometry_checked(caplog: pytest.LogCaptureFixture) -> None:
    geom = WindowGeometry(make_layout(), 2, 1)
    store = dist.HashStore()

    def factory(nbytes: int) -> SymmetricHeap:
        return LoopbackHeap({0: torch.zeros(nbytes, dtype=torch.uint8)}, 0)

    with caplog.at_level(logging.INFO, logger="afd.connectors.window"):
        Window.create(store, 0, 1, geom, factory, timeout_s=1.0)
    text = caplog.text
    assert str(geom.nbytes) in text and "routed_x" in text and "shared_x" in text and "2 regions x 1 ring" in text


def test_geometry_mismatch_names_the_parameter() -> None:
    store = dist.HashStore()
    good = WindowGeometry(make_layout(hidden=24), 2, 1).as_dict()
    bad = WindowGeometry(make_layout(hidden=32), 2, 1).as_dict()
    errors: dict[int, BaseException] = {}

    def run(rank: int, geometry: dict) -> None:
        try:
            check_geometry(store, rank, 2, geometry, timeout_s=5.0)
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r, g)) for r, g in enumerate((good, bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, ValueError) and "hidden_size" in str(e)


def test_geometry_wait_is_bounded() -> None:
    with pytest.raises(TimeoutError, match="window geometry"):
        check_geometry(dist.HashStore(), 0, 2, {"x": 1}, timeout_s=0.2)


# --------------------------------------------------------------------------------------------- issue 9

SEQ_BOUNDARIES = [2**31 - 1, 2**32 - 1]


@pytest.mark.parametrize("seq", [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**63 - 1])
def test_seq_codec_keeps_low_32_bits_and_restores_the_flag(seq: int) -> None:
    """seq/echo_seq travel as the int32 bit pattern of their low 32 bits; a match mod 2**32 restores them."""
    echo = max(seq - 1, 0)
    words = encode_header(SlotHeader(seq=seq, echo_seq=echo, flags=FLAG_RESPONSE), 2)
    stored = torch.tensor(words, dtype=torch.int32).tolist()  # what a slot's header really holds
    assert stored == words
    assert (stored[W_SEQ] % 2**32, stored[W_ECHO_SEQ] % 2**32) == (seq % 2**32, echo % 2**32)
    back = decode_header(stored, 2, expect_seq=seq, expect_echo_seq=echo)
    assert (back.seq, back.echo_seq) == (seq, echo)  # the full values, as the flag and the request had them
    raw = decode_header(stored, 2)  # no expectation: the unsigned low 32 bits
    assert (raw.seq, raw.echo_seq) == (seq % 2**32, echo % 2**32)
    with pytest.raises(WindowProtocolError, match="does not match its flag"):
        decode_header(stored, 2, expect_seq=seq + 1)
    with pytest.raises(WindowProtocolError, match="echoes"):
        decode_header(stored, 2, expect_echo_seq=echo + 1)


def test_seq_comparison_is_mod_2_32() -> None:
    assert seq_matches(2**32 + 5, 5) and seq_matches(2**31, 2**31 + 2**32)
    assert not seq_matches(2**32 - 1, 2**32) and not seq_matches(0, 2**31)
    with pytest.raises(ValueError, match="non-negative"):
        encode_header(SlotHeader(seq=-1), 2)


@pytest.mark.parametrize("boundary", SEQ_BOUNDARIES)
def test_window_request_response_across_seq_boundary(boundary: int) -> None:
    """Both sides' counters start just below 2**31 - 1 / 2**32 - 1 and cross it: every round trip
    checks seq against the flag and echo_seq against the request, as a run does."""
    geom = WindowGeometry(make_layout(hidden=4, dtype=torch.float32), num_regions=2, ring_depth=1)
    attn, ffn = make_pair(geom)  # world rank 0 = attention 0, world rank 1 = FFN 0
    attn._seq = boundary - 2
    ffn._seq = boundary - 3
    for step in range(4):
        x = torch.full((2, 4), float(step))
        req = SlotHeader(layer_idx=1, num_tokens=2, routed_tokens=2, shared_tokens=1, expert_counts=(2,))
        seq = attn.write_slot(1, 0, 0, req, routed_x=x, shared_x=x[:1])
        assert seq == boundary - 1 + step
        got = ffn.poll(1.0)
        assert got is not None and got.header.seq == seq
        torch.testing.assert_close(got.routed_x, x)
        reply = dataclasses.replace(got.header, echo_seq=got.header.seq, flags=FLAG_RESPONSE)
        ffn.write_slot(0, 0, 0, reply, routed_x=got.routed_x * 2, shared_x=got.shared_x * 3)
        back = attn.poll(1.0, expect_echo={0: seq})
        assert back is not None and back.header.echo_seq == seq and back.header.is_response
        torch.testing.assert_close(back.routed_x, x * 2)
        torch.testing.assert_close(back.shared_x, x[:1] * 3)
    assert attn._seq > boundary and ffn._seq > boundary


def test_shutdown_has_its_own_flag_and_leaves_the_slot_intact() -> None:
    """A shutdown raised while the peer reads a message in stage 0 does not touch that message."""
    geom = WindowGeometry(make_layout(hidden=4, dtype=torch.float32), num_regions=2, ring_depth=1)
    sender, receiver = make_pair(geom)
    x = torch.ones(1, 4)
    seq = sender.write_slot(1, 0, 0, SlotHeader(num_tokens=1, shared_tokens=1), shared_x=x)
    flags = receiver._read_flags()
    receiver._read_flags = lambda: flags  # the receiver read the flags before the shutdown ...
    before = receiver.heap.local[geom.flags_bytes :].clone()
    sender.write_shutdown(1, 0)
    assert torch.equal(receiver.heap.local[geom.flags_bytes :], before)  # ... and no slot byte changed
    msg = receiver.poll(0.0)
    assert msg is not None and msg.header.seq == seq and not msg.header.is_shutdown
    del receiver._read_flags
    msg = receiver.poll(0.0)
    assert msg is not None and msg.header.is_shutdown and msg.region == 0 and msg.stage == -1
    assert receiver.poll(0.0) is None


def test_shutdown_drops_what_the_departed_sender_left_unread() -> None:
    geom = WindowGeometry(make_layout(hidden=4, dtype=torch.float32), num_regions=2, ring_depth=2)
    sender, receiver = make_pair(geom)
    sender.write_slot(1, 1, 0, SlotHeader())
    sender.write_slot(1, 0, 0, SlotHeader())
    sender.write_shutdown(1, 1)
    msg = receiver.poll(0.0)
    assert msg.header.is_shutdown and msg.region == 1
    msg = receiver.poll(0.0)
    assert not msg.header.is_shutdown and msg.region == 0
    assert receiver.poll(0.0) is None
    with pytest.raises(ValueError, match="write_shutdown"):
        sender.write_slot(1, 0, 0, SlotHeader(flags=FLAG_SHUTDOWN))


def test_version_2_slot_has_no_index_tables_and_v1_peers_are_refused() -> None:
    """route_table and shared_idx were written on every send and never read: gone, and the version says so."""
    layout = make_layout(hidden=64, dtype=torch.bfloat16)
    assert VERSION == 2 and "route_table" not in layout.fields and "shared_idx" not in layout.fields
    words = encode_header(SlotHeader(), 3)
    with pytest.raises(WindowProtocolError, match="version 1, this build speaks 2"):
        decode_header([words[0], 1, *words[2:]], 3)
    store = dist.HashStore()
    mine = WindowGeometry(layout, 2, 1).as_dict()
    store.set("afd_async/geometry/1", json.dumps({**mine, "version": 1}))
    with pytest.raises(ValueError, match="protocol version 2 on world rank 0 but 1 on world rank 1"):
        check_geometry(store, 0, 2, mine, timeout_s=1.0)
