"""Slot layout, header and one-sided window protocol of the `async` connector (single process)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

import pytest
import torch
import torch.distributed as dist

from afd.connectors.asynchronous.window import Window
from afd.connectors.asynchronous.wire import (
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


def make_layout(hidden: int = 24, dtype: torch.dtype = torch.bfloat16, num_ffn: int = 2) -> SlotLayout:
    return SlotLayout.for_model(hidden_size=hidden, dtype=dtype, topk=2, num_ffn=num_ffn, max_num_batched_tokens=10)


def make_pair(geometry: WindowGeometry) -> tuple[Window, Window]:
    windows = {r: torch.full((geometry.nbytes,), 7, dtype=torch.uint8) for r in range(2)}  # garbage before zeroing
    return Window(LoopbackHeap(windows, 0), geometry), Window(LoopbackHeap(windows, 1), geometry)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [1, 7, 64])
def test_slot_fields_disjoint_aligned_in_bounds(dtype: torch.dtype, hidden: int) -> None:
    layout = make_layout(hidden, dtype)
    fields = list(layout.fields.values())
    assert [f.name for f in fields] == ["header", "rows", "topk_ids", "topk_weights"]
    for f in fields:
        assert f.offset % ALIGN == 0 and f.nbytes % ALIGN == 0
        numel = 1
        for d in f.shape:
            numel *= d
        assert numel * torch.empty((), dtype=f.dtype).element_size() <= f.nbytes
    # rows hold row_cap request rows (model dtype) or as many fp32 reply rows (F = 2)
    assert layout.reply_dtype == torch.float32
    assert layout.fields["rows"].shape == (layout.row_cap * hidden * 4,)
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
            expect = {
                "header": (torch.int32, (HEADER_WORDS,), "header"),
                "x": (torch.float16, (layout.row_cap, 5), "rows"),
                "out": (torch.float32, (layout.row_cap, 5), "rows"),
                "topk_ids": (torch.int32, (layout.row_cap, 2), "topk_ids"),
                "topk_weights": (torch.float32, (layout.row_cap, 2), "topk_weights"),
            }
            for name, (dtype, shape, field) in expect.items():
                v = getattr(views, name)
                assert v.dtype == dtype and tuple(v.shape) == shape
                assert v.data_ptr() - base == off + layout.fields[field].offset
                v.fill_(1)  # writable under its dtype
                if name != "x":  # x and out alias the same rows
                    owner[off + layout.fields[field].offset : off + layout.fields[field].offset + v.nbytes] += 1
    assert int(owner.max()) == 1
    with pytest.raises(IndexError):
        geom.slot_offset(3, 0)


def test_capacities_follow_design() -> None:
    def layout(num_ffn: int, multiplier: float = 2.0, dtype: torch.dtype = torch.bfloat16) -> SlotLayout:
        return SlotLayout.for_model(
            hidden_size=8,
            dtype=dtype,
            topk=6,
            num_ffn=num_ffn,
            max_num_batched_tokens=100,
            routed_cap_multiplier=multiplier,
        )

    assert layout(4).token_cap == 100
    assert layout(4).row_cap == 100  # ceil(100 * 4 / 4) * 2.0, capped: a token goes to a rank at most once
    assert layout(16).row_cap == 76  # ceil(100 * 6 / 16) * 2.0
    assert layout(16, multiplier=1.0).row_cap == 38
    assert layout(1).reply_dtype == torch.bfloat16  # one FFN rank: its partial is the whole answer
    assert layout(2).reply_dtype == torch.float32  # partials of several ranks are added in fp32
    assert layout(2, dtype=torch.float16).reply_dtype == torch.float32


def test_header_round_trip_and_checks() -> None:
    h = SlotHeader(layer_idx=3, num_tokens=9, num_rows=5, shared_rows=4, seq=11, echo_seq=7, stage=1)
    words = encode_header(h)
    assert len(words) == HEADER_WORDS and words[0] == MAGIC and words[1] == VERSION
    assert int.from_bytes(torch.tensor(words[:1], dtype=torch.int32).numpy().tobytes(), "little") == MAGIC
    assert torch.tensor(words[:1], dtype=torch.int32).numpy().tobytes() == b"AFDG"
    back = decode_header(words, expect_seq=11, expect_echo_seq=7)
    assert back == h
    with pytest.raises(WindowProtocolError, match="magic"):
        decode_header([0, *words[1:]])
    with pytest.raises(WindowProtocolError, match="version"):
        decode_header([words[0], VERSION + 1, *words[2:]])
    with pytest.raises(WindowProtocolError, match="echo"):
        decode_header(words, expect_echo_seq=8)
    with pytest.raises(WindowProtocolError, match="seq"):
        decode_header(words, expect_seq=12)
    with pytest.raises(WindowProtocolError, match="shared rows"):
        decode_header([*words[:5], 3, 4, *words[7:]])  # 4 shared rows of 3
    with pytest.raises(ValueError, match="shared rows"):
        encode_header(SlotHeader(num_rows=1, shared_rows=2))


def test_shutdown_bit() -> None:
    words = encode_header(SlotHeader(flags=FLAG_SHUTDOWN | FLAG_RESPONSE))
    assert words[2] & (1 << 1)
    h = decode_header(words, expect_echo_seq=99)  # a shutdown answers nothing: no echo check
    assert h.is_shutdown and h.is_response
    assert not decode_header(encode_header(SlotHeader())).is_shutdown


def test_write_then_poll_zero_copy() -> None:
    geom = WindowGeometry(make_layout(hidden=4, dtype=torch.float32), num_regions=2, ring_depth=1)
    sender, receiver = make_pair(geom)
    assert int(receiver.heap.local.sum()) == 0  # zeroed at init
    assert receiver.poll(0.0) is None
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    ids = torch.tensor([[0, 5], [2, 3], [1, 4]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.0, 3.0]])
    header = SlotHeader(layer_idx=2, num_tokens=5, num_rows=3, shared_rows=2)
    seq = sender.write_slot(1, region=1, stage=0, header=header, rows=x, topk_ids=ids, topk_weights=weights)
    msg = receiver.poll(1.0)
    assert msg is not None and msg.region == 1 and msg.stage == 0
    assert msg.header.seq == seq and msg.header.layer_idx == 2 and msg.header.shared_rows == 2
    torch.testing.assert_close(msg.rows, x)
    assert torch.equal(msg.topk_ids, ids) and torch.equal(msg.topk_weights, weights)
    local = receiver.heap.local
    assert local.data_ptr() <= msg.rows.data_ptr() < local.data_ptr() + local.numel()  # a view, no copy
    assert receiver.poll(0.0) is None  # seen mirror: no second delivery
    with pytest.raises(ValueError, match="needs its topk_ids"):
        sender.write_slot(1, 1, 0, header, rows=x, topk_weights=weights)


@pytest.mark.parametrize(("num_ffn", "reply_dtype"), [(1, torch.bfloat16), (2, torch.float32)])
def test_reply_rows_take_the_reply_dtype(num_ffn: int, reply_dtype: torch.dtype) -> None:
    """An FFN rank hands over its fp32 sums; they travel in the reply dtype, rounded once at most."""
    geom = WindowGeometry(make_layout(hidden=4, dtype=torch.bfloat16, num_ffn=num_ffn), num_regions=2, ring_depth=1)
    attn, ffn = make_pair(geom)
    sums = torch.tensor([[1.0 + 2**-12, 2.0, 3.0, 4.0]])  # not representable in bf16
    reply = SlotHeader(num_tokens=1, num_rows=1, flags=FLAG_RESPONSE)
    ffn.write_slot(0, 0, 0, reply, rows=sums)  # no top-k in a reply
    msg = attn.poll(1.0)
    assert msg.rows.dtype == reply_dtype and msg.topk_ids.shape == (0, 2)
    assert torch.equal(msg.rows, sums.to(reply_dtype))


def test_overflow_raises_and_publishes_nothing() -> None:
    layout = make_layout(hidden=4, dtype=torch.float32, num_ffn=8)  # row_cap 6 < token_cap 10
    sender, receiver = make_pair(WindowGeometry(layout, 2, 1))
    n = layout.row_cap + 1
    with pytest.raises(WindowOverflow, match="routed_cap_multiplier"):
        sender.write_slot(1, 0, 0, SlotHeader(num_tokens=n, num_rows=n), rows=torch.zeros(n, 4))
    with pytest.raises(WindowOverflow, match="token_cap"):
        sender.write_slot(1, 0, 0, SlotHeader(num_tokens=layout.token_cap + 1))
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


def test_poll_many_takes_every_ready_message_of_one_flag_read() -> None:
    """The FFN batches the items waiting together: one flag read returns all of them, shutdowns first."""
    geom = WindowGeometry(make_layout(hidden=2, dtype=torch.float32), num_regions=3, ring_depth=2)
    windows = {r: torch.zeros(geom.nbytes, dtype=torch.uint8) for r in range(4)}
    senders = [Window(LoopbackHeap(windows, r), geom) for r in range(3)]
    receiver = Window(LoopbackHeap(windows, 3), geom)
    assert receiver.poll_many(0.0) == []
    for region, stage in ((0, 0), (1, 0), (1, 1), (2, 1)):
        senders[region].write_slot(3, region, stage, SlotHeader(layer_idx=region))
    senders[2].write_shutdown(3, 2)  # drops region 2's unread message
    got = receiver.poll_many(0.0)
    assert [(m.region, m.stage, m.header.is_shutdown) for m in got] == [
        (2, -1, True),
        (0, 0, False),
        (1, 0, False),
        (1, 1, False),
    ]
    senders[0].write_slot(3, 0, 1, SlotHeader())
    senders[1].write_slot(3, 1, 0, SlotHeader())
    # the scan goes on after the last hit (region 1, stage 1): region 0 first this time
    assert [(m.region, m.stage) for m in receiver.poll_many(0.0, max_messages=1)] == [(0, 1)]
    assert [(m.region, m.stage) for m in receiver.poll_many(0.0)] == [(1, 0)]
    assert receiver.poll_many(0.0) == []


def test_window_size_logged_and_geometry_checked(caplog: pytest.LogCaptureFixture) -> None:
    geom = WindowGeometry(make_layout(), 2, 1)
    store = dist.HashStore()

    def factory(nbytes: int) -> SymmetricHeap:
        return LoopbackHeap({0: torch.zeros(nbytes, dtype=torch.uint8)}, 0)

    with caplog.at_level(logging.INFO, logger="afd.connectors.asynchronous.window"):
        Window.create(store, 0, 1, geom, factory, timeout_s=1.0)
    text = caplog.text
    assert str(geom.nbytes) in text and "rows" in text and "topk_weights" in text and "2 regions x 1 ring" in text


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


# --------------------------------------------------------------------------------------------- faults

SEQ_BOUNDARIES = [2**31 - 1, 2**32 - 1]


@pytest.mark.parametrize("seq", [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**63 - 1])
def test_seq_codec_keeps_low_32_bits_and_restores_the_flag(seq: int) -> None:
    """seq/echo_seq travel as the int32 bit pattern of their low 32 bits; a match mod 2**32 restores them."""
    echo = max(seq - 1, 0)
    words = encode_header(SlotHeader(seq=seq, echo_seq=echo, flags=FLAG_RESPONSE))
    stored = torch.tensor(words, dtype=torch.int32).tolist()  # what a slot's header really holds
    assert stored == words
    assert (stored[W_SEQ] % 2**32, stored[W_ECHO_SEQ] % 2**32) == (seq % 2**32, echo % 2**32)
    back = decode_header(stored, expect_seq=seq, expect_echo_seq=echo)
    assert (back.seq, back.echo_seq) == (seq, echo)  # the full values, as the flag and the request had them
    raw = decode_header(stored)  # no expectation: the unsigned low 32 bits
    assert (raw.seq, raw.echo_seq) == (seq % 2**32, echo % 2**32)
    with pytest.raises(WindowProtocolError, match="does not match its flag"):
        decode_header(stored, expect_seq=seq + 1)
    with pytest.raises(WindowProtocolError, match="echoes"):
        decode_header(stored, expect_echo_seq=echo + 1)


def test_seq_comparison_is_mod_2_32() -> None:
    assert seq_matches(2**32 + 5, 5) and seq_matches(2**31, 2**31 + 2**32)
    assert not seq_matches(2**32 - 1, 2**32) and not seq_matches(0, 2**31)
    with pytest.raises(ValueError, match="non-negative"):
        encode_header(SlotHeader(seq=-1))


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
        ids, weights = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
        req = SlotHeader(layer_idx=1, num_tokens=2, num_rows=2, shared_rows=1)
        seq = attn.write_slot(1, 0, 0, req, rows=x, topk_ids=ids, topk_weights=weights)
        assert seq == boundary - 1 + step
        got = ffn.poll(1.0)
        assert got is not None and got.header.seq == seq
        torch.testing.assert_close(got.rows, x)
        reply = dataclasses.replace(got.header, echo_seq=got.header.seq, flags=FLAG_RESPONSE)
        ffn.write_slot(0, 0, 0, reply, rows=got.rows * 2)
        back = attn.poll(1.0, expect_echo={0: seq})
        assert back is not None and back.header.echo_seq == seq and back.header.is_response
        torch.testing.assert_close(back.rows, x * 2)
    assert attn._seq > boundary and ffn._seq > boundary


def test_shutdown_has_its_own_flag_and_leaves_the_slot_intact() -> None:
    """A shutdown raised while the peer reads a message in stage 0 does not touch that message."""
    geom = WindowGeometry(make_layout(hidden=4, dtype=torch.float32), num_regions=2, ring_depth=1)
    sender, receiver = make_pair(geom)
    x = torch.ones(1, 4)
    header = SlotHeader(num_tokens=1, num_rows=1, shared_rows=1)
    seq = sender.write_slot(
        1, 0, 0, header, rows=x, topk_ids=torch.zeros(1, 2, dtype=torch.int32), topk_weights=x[:, :2]
    )
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


def test_version_4_slot_carries_topk_in_band_and_older_peers_are_refused() -> None:
    """Version 3's layout (one row per (token, FFN rank) with ids and weights; no per-expert counts in the header)
    with version 4's reply stamp (the request's seq): a version 3 peer stamps replies otherwise and is refused."""
    layout = make_layout(hidden=64, dtype=torch.bfloat16)
    assert VERSION == 4 and set(layout.fields) == {"header", "rows", "topk_ids", "topk_weights"}
    words = encode_header(SlotHeader())
    assert len(words) == HEADER_WORDS
    with pytest.raises(WindowProtocolError, match="version 3, this build speaks 4"):
        decode_header([words[0], 3, *words[2:]])
    store = dist.HashStore()
    mine = WindowGeometry(layout, 2, 1).as_dict()
    assert mine["reply_dtype"] == "float32" and mine["topk"] == 2
    store.set("afd_async/geometry/1", json.dumps({**mine, "version": 3}))
    with pytest.raises(ValueError, match="protocol version 4 on world rank 0 but 3 on world rank 1"):
        check_geometry(store, 0, 2, mine, timeout_s=1.0)
