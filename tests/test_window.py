"""Slot layout, header and one-sided window protocol of the `async` connector (single process)."""

from __future__ import annotations

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
    SlotHeader,
    SlotLayout,
    WindowGeometry,
    WindowOverflow,
    WindowProtocolError,
    check_geometry,
    decode_header,
    encode_header,
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
    assert [f.name for f in fields] == ["header", "route_table", "routed_x", "shared_idx", "shared_x"]
    elem = torch.empty((), dtype=f.dtype).element_size() if (f := fields[2]) else 0
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
    owner[: 8 * geom.num_slots] += 1  # flags
    assert geom.flags_bytes % ALIGN == 0
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
    seq = sender.write_slot(
        1,
        region=1,
        stage=0,
        header=header,
        route_table=torch.tensor([0, 2, 1], dtype=torch.int32),
        routed_x=x,
        shared_idx=torch.tensor([0, 1], dtype=torch.int32),
        shared_x=x[:2] * 10,
    )
    msg = receiver.poll(1.0)
    assert msg is not None and msg.region == 1 and msg.stage == 0
    assert msg.header.seq == seq and msg.header.layer_idx == 2 and msg.header.expert_counts == (1, 2, 0)
    torch.testing.assert_close(msg.routed_x, x)
    torch.testing.assert_close(msg.shared_x, x[:2] * 10)
    assert msg.route_table.tolist() == [0, 2, 1]
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
