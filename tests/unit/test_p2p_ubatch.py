"""Micro-batch ping-pong over the p2p connector (`p2p_ubatching`): the config, the control
message and the serve order without processes, and launched runs against the reference."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from helpers.p2p_fakes import P2pStandInFFN, RecordingPG, fake_world

from afd.config import ConfigError, parse_config
from afd.connectors.p2p.attention import TAG_CTRL, TAG_OUT, TAG_ROWS, P2pAttentionExchange, RowPayload
from afd.connectors.p2p.ffn import P2pFFNLoop
from afd.topology import SyncTopology

H, K = 16, 3  # the stand-in FFN's hidden size and top-k


# ---------------------------------------------------------------- the config


def test_config_is_off_by_default_and_validated() -> None:
    def extra(**keys):
        return parse_config({"connector": "p2p", "connector_extra_config": keys}).connector_extra_config

    assert extra().num_ubatches == 1 and extra(p2p_num_ubatches=3).num_ubatches == 1  # off: whole steps
    assert (
        extra(p2p_ubatching=True).num_ubatches == 2 and extra(p2p_ubatching=True, p2p_num_ubatches=3).num_ubatches == 3
    )
    bad = [
        ({"p2p_ubatching": True, "p2p_num_ubatches": 1}, "p2p_num_ubatches must be at least 2 when p2p_ubatching"),
        ({"p2p_num_ubatches": 17}, "p2p_num_ubatches must be between 1 and 16, got 17"),
        ({"p2p_num_ubatches": "2"}, "p2p_num_ubatches must be an integer"),
        ({"p2p_ubatching": 1}, "p2p_ubatching must be true or false"),
        ({"async_moe_ubatching": True}, "unknown key 'async_moe_ubatching' in connector_extra_config for p2p"),
    ]
    for keys, message in bad:
        with pytest.raises(ConfigError, match=message):
            extra(**keys)


# ---------------------------------------------------------------- the wire, without processes


def test_default_control_message_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without micro-batches the step's control message is the three words it always was."""
    pg = RecordingPG({(0, TAG_OUT): [torch.zeros(5, 4)]})
    ex = P2pAttentionExchange(fake_world(monkeypatch, "attention", 0, pg), SyncTopology(1, 1), gate_on_attention=False)
    ex.begin_step(5)
    ex(0, torch.randn(5, 4), None)
    assert [(dst, tag, buf.tolist()) for dst, tag, buf in pg.sent if tag == TAG_CTRL] == [(0, TAG_CTRL, [5, 0, 0])]
    assert ex.num_ubatches == 1 and ex.groups.back is None


def test_split_step_announces_its_slots_and_keeps_every_send_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """m = 3, a step of 7 tokens in micro-batches of 4 and 3: the control message carries [4, 3, 0]; both
    micro-batches' rows leave before the first answer is taken, answers come back in send order, and a
    whole step (slot 0, through __call__) and the step-end checks still hold."""
    topo = SyncTopology(1, 1)
    answers = [torch.full((4, 4), 1.0), torch.full((3, 4), 2.0), torch.full((4, 4), 3.0), torch.full((3, 4), 4.0)]
    pg = RecordingPG({(0, TAG_OUT): [*answers, torch.full((2, 4), 5.0)]})
    ex = P2pAttentionExchange(
        fake_world(monkeypatch, "attention", 0, pg),
        topo,
        gate_on_attention=False,
        boundary_layers=[0, 1],
        num_ubatches=3,
    )
    ex.begin_step(7, [4, 3])
    assert pg.sent[-1][1] == TAG_CTRL and pg.sent[-1][2].tolist() == [7, 0, 0, 4, 3, 0]
    x0, x1 = torch.randn(4, 4), torch.randn(3, 4)
    ex.send(0, x0, None)
    ex.send(0, x1, None)
    rows = [buf for _, tag, buf in pg.sent if tag == TAG_ROWS]
    assert len(rows) == 2 and torch.equal(rows[0], x0) and torch.equal(rows[1], x1)  # both on the wire
    assert torch.equal(ex.recv(), answers[0]) and torch.equal(ex.recv(), answers[1])
    ex.send(1, x0, None)
    with pytest.raises(RuntimeError, match="got 4 rows, begin_step announced 3 for micro-batch 1"):
        ex.send(1, x0, None)
    ex.send(1, x1, None)
    with pytest.raises(RuntimeError, match="step ended after 4 of 4 boundary sends \\(2 answers not taken\\)"):
        ex.begin_step(2)
    assert torch.equal(ex.recv(), answers[2]) and torch.equal(ex.recv(), answers[3])
    with pytest.raises(RuntimeError, match="through send/recv"):
        ex(0, x0, None)
    with pytest.raises(ValueError, match="do not split a step of 7 tokens into at most 3"):
        ex.begin_step(7, [4, 2])
    ex.begin_step(2)  # a whole step: slot 0
    assert pg.sent[-1][2].tolist() == [2, 0, 0, 2, 0, 0]
    torch.testing.assert_close(ex(0, torch.randn(2, 4), None), torch.full((2, 4), 5.0))


def test_ffn_serves_every_slot_of_a_layer_in_send_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """2A1F, m = 3: attention 0 runs micro-batches of 3 and 2 tokens, attention 1 one of 4 (its slot 1 empty,
    slot 2 empty everywhere). Per layer the hub serves slot 0 (both spokes, concatenated) then slot 1 (spoke 0
    alone) and not slot 2; each answer equals the layer's reference on that micro-batch's rows."""
    topo, model = SyncTopology(2, 1), P2pStandInFFN()
    layout, g = RowPayload(H, K, torch.float32), torch.Generator().manual_seed(0)
    slots = {0: [3, 2], 1: [4, 0]}  # attention rank -> rows per slot
    a0, a1 = topo.world_rank("attention", 0), topo.world_rank("attention", 1)
    inbox: dict = {
        (a0, TAG_CTRL): [torch.tensor([5, 0, 0, 3, 2, 0])],
        (a1, TAG_CTRL): [torch.tensor([4, 0, 0, 4, 0, 0])],
    }
    want = []  # (dst, answer) in the order the hub must send them
    for layer in (1, 2):
        for slot in range(2):
            for a in (0, 1):
                n = slots[a][slot]
                if n == 0:
                    continue
                x = torch.randn(n, H, generator=g)
                r = model.route(layer, x)
                inbox.setdefault((topo.world_rank("attention", a), TAG_ROWS), []).append(
                    layout.pack(x, r.topk_ids, r.topk_weights)
                )
                want.append((topo.world_rank("attention", a), model.reference(layer, x, gate_on_attention=True)))
    pg = RecordingPG(inbox)
    loop = P2pFFNLoop(
        fake_world(monkeypatch, "ffn", 0, pg),
        topo,
        model,
        num_experts=7,
        topk=K,
        hidden_size=H,
        dtype=torch.float32,
        boundary_layers=[1, 2],
        gate_on_attention=True,
        num_ubatches=3,
    )
    assert loop.step() and loop.num_slots_served == 2
    assert [src for src, tag in pg.recvd if tag == TAG_ROWS] == [a0, a1, a0] * 2
    outs = [(dst, out) for dst, tag, out in pg.sent if tag == TAG_OUT]
    assert [dst for dst, _ in outs] == [dst for dst, _ in want]
    for (_, got), (_, expected) in zip(outs, want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def one_ffn_loop(monkeypatch: pytest.MonkeyPatch, pg: RecordingPG, num_ubatches: int) -> P2pFFNLoop:
    """1A1F's FFN rank over a recording group, with no model (for the control plane alone)."""
    return P2pFFNLoop(
        fake_world(monkeypatch, "ffn", 0, pg),
        SyncTopology(1, 1),
        SimpleNamespace(),
        num_experts=7,
        topk=K,
        hidden_size=H,
        dtype=torch.float32,
        boundary_layers=[1],
        gate_on_attention=True,
        num_ubatches=num_ubatches,
    )


def test_ffn_refuses_slots_that_do_not_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    pg = RecordingPG({(1, TAG_CTRL): [torch.tensor([5, 0, 0, 3, 1])]})
    loop = one_ffn_loop(monkeypatch, pg, num_ubatches=2)
    with pytest.raises(RuntimeError, match=re.escape("announced 5 tokens in micro-batches of [3, 1]")):
        loop.step()


def test_ffn_ranks_agree_on_the_slots_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several FFN ranks each serves the largest number of slots any of them sees filled (each slot is an
    expert all-to-all): a rank whose peers left slot 1 empty still serves it when another group filled it."""

    class MaxPG:  # the other FFN ranks' view: 2 slots in use
        def allreduce(self, tensors: list[torch.Tensor], opts) -> None:
            assert opts.reduceOp == torch.distributed.ReduceOp.MAX
            tensors[0].clamp_(min=2)

    loop = one_ffn_loop(monkeypatch, RecordingPG(), num_ubatches=3)
    whole, split = [{0: 5}, {0: 0}, {0: 0}], [{0: 2}, {0: 2}, {0: 1}]
    assert loop._slots_in_use(whole) == 1 and loop._slots_in_use(split) == 3
    assert loop._slots_in_use([{0: 0}] * 3) == 1
    loop.groups.ffn_wave = SimpleNamespace(pg=MaxPG())
    assert loop._slots_in_use(whole) == 2 and loop._slots_in_use(split) == 3
