"""The `p2p` connector: synchronous attention <-> FFN exchange for any A:F ratio.

Per engine step every attention replica (in lockstep: the DP wave) tells the FFN members of its
sync group its token count; per boundary layer it sends its MoE input rows (plus the routing when
the gate is on attention) and receives the MoE output. `A >= F`: the FFN hub concatenates its
spokes' rows in ascending attention rank. `A < F`: the attention hub splits its T tokens over its
FFN members by `even_split`. Each (peer, layer) is one fused message: hidden states, top-k ids and
weights packed into one buffer whose layout both sides derive from the control plane's count
(`afd.connectors.p2p.wire.RowPayload`). The FFN role computes each layer expert-parallel: (row, k)
pairs go to the FFN rank owning the expert (`expert_ranges`) through an all-to-all, and come back
for a weighted fp32 sum plus the locally computed shared experts.

Micro-batches (`p2p_ubatching`, m = `num_ubatches` > 1): the engine splits a step into at most m
micro-batches and drives them in ping-pong through `send` (posts the fused message, returns at once) and
`recv` (the oldest send's answer). Every step of the wave then has m slots per boundary layer: the control
message carries each slot's token count (a whole step fills slot 0, unused slots are empty and cost no
message), and the FFN ranks serve, layer by layer, the slots in send order up to the last one any rank of
the wave filled (they agree on it once per step), so the expert all-to-alls stay in lockstep. Answers travel
on a second group (`back`): on NCCL its own communicator and stream, so a micro-batch's rows never queue
behind another's answer on one peer-to-peer stream.

Reading order: wiring (pure, in `p2p_wire`) -> groups -> attention exchange (here) -> FFN loop (`p2p_ffn`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from afd.connectors.base import Exchange
from afd.connectors.p2p.wire import (  # noqa: F401 - the wiring is part of this connector's API
    EpDispatch,
    RowPayload,
    RowSend,
    attn_sends,
    ep_send_matrix,
    ffn_recvs,
    ffn_rows,
    plan_ep_dispatch,
    plan_layer,
)
from afd.distributed.world import Group, World, device_for
from afd.profiling.timeline import Timeline
from afd.routing import Routing
from afd.topology import SyncTopology

logger = logging.getLogger(__name__)

# Control message per step, attention -> FFN: [num_tokens, is_wave_finished, is_wave_idle] int64, followed with
# micro-batches by the m slots' token counts. An idle wave (no replica has work: a server between requests) skips
# every layer on both sides.
CTRL_LEN = 3
TAG_CTRL, TAG_ROWS, TAG_OUT = 0, 1, 4  # TAG_ROWS: the fused payload (it replaced x, ids, weights: tags 1, 2, 3)


# ---------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------
@dataclass
class P2pGroups:
    """This rank's process groups for one p2p connector instance (None where not a member)."""

    data: Group  # its sync group: FFN members first, then attention members (world order)
    ctrl: Group  # same members, always gloo (host-side counts)
    ep: Group | None  # FFN role: all FFN ranks, group rank = FFN rank
    wave: Group | None  # attention role: all attention ranks, group rank = attention rank
    back: Group | None = None  # micro-batches: the sync group's members again, for the answers (else `data`)
    ffn_wave: Group | None = None  # micro-batches, FFN role, F > 1: all FFN ranks, gloo (the slots in use)

    @property
    def answers(self) -> Group:
        """The group FFN -> attention answers travel on."""
        return self.back if self.back is not None else self.data


def ctrl_len(num_ubatches: int) -> int:
    """Words of the step's control message: the slot counts travel only with micro-batches (m > 1)."""
    return CTRL_LEN + (num_ubatches if num_ubatches > 1 else 0)


def build_p2p_groups(world: World, topology: SyncTopology, name: str = "p2p", answers_apart: bool = False) -> P2pGroups:
    """Create this rank's groups; every rank calls it once per connector with the same `name`.
    `answers_apart` (micro-batches): FFN -> attention answers get their own group `back`."""
    if world.world_size != topology.world_size or world.me.world_order != "ffn_first":
        raise ValueError("the p2p connector needs a world of A+F ranks in ffn_first order")
    role, role_rank = world.me.role, world.me.role_rank
    sync = topology.group(role, role_rank)
    members = topology.group_world_ranks(sync)
    data = world.new_group(f"{name}/sync{sync.index}/data", members)
    ctrl = data if world.backend == "gloo" else world.new_group(f"{name}/sync{sync.index}/ctrl", members, "gloo")
    ffn_world = [topology.world_rank("ffn", f) for f in range(topology.num_ffn)]
    attn_world = [topology.world_rank("attention", a) for a in range(topology.num_attention)]
    back = world.new_group(f"{name}/sync{sync.index}/back", members) if answers_apart else None
    ep = world.new_group(f"{name}/ffn_ep", ffn_world) if role == "ffn" else None
    wave = world.new_group(f"{name}/attn_wave", attn_world, "gloo") if role == "attention" else None
    ffn_wave = None
    if answers_apart and role == "ffn" and topology.num_ffn > 1:
        ffn_wave = world.new_group(f"{name}/ffn_wave", ffn_world, "gloo")
    assert data is not None and ctrl is not None
    return P2pGroups(data=data, ctrl=ctrl, ep=ep, wave=wave, back=back, ffn_wave=ffn_wave)


# ---------------------------------------------------------------------------------------------
# Attention side
# ---------------------------------------------------------------------------------------------
@dataclass
class PendingRows:
    """One boundary's rows on the wire (`send`) until `recv` takes the answer: the transfers in flight, the
    answer buffers they fill (one per FFN peer, in row order) and the payloads the sends read (held until
    they complete)."""

    layer_idx: int
    works: list[tuple[Any, str]]
    outs: list[torch.Tensor]  # [n_i, H] each
    payloads: list[torch.Tensor]


class P2pAttentionExchange(Exchange):
    """The model's `Exchange` for one attention replica, over p2p.

    Drive it per step: `while ex.step_wave(engine.has_work()): engine.step()` — the engine calls
    `begin_step(T)` then the exchange once per boundary layer (with `[0, H]` when idle). With
    `num_ubatches` m > 1 the engine may instead split the step: `begin_step(T, [t_0, .., t_k-1])` (k <= m)
    then `send` / `recv` in ping-pong (`afd.model.attention_side.run_ubatches`), micro-batch i's boundaries in slot i.
    """

    def __init__(
        self,
        world: World,
        topology: SyncTopology,
        *,
        gate_on_attention: bool,
        topk: int | None = None,
        boundary_layers: Sequence[int] | None = None,
        num_ubatches: int = 1,
        name: str = "p2p",
    ) -> None:
        if world.me.role != "attention":
            raise ValueError(f"{world.me.name} is not an attention rank")
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be at least 1, got {num_ubatches}")
        self.world, self.topology, self.attn_rank = world, topology, world.me.role_rank
        self.gate_on_attention, self.topk = gate_on_attention, topk
        self.boundary_layers = list(boundary_layers) if boundary_layers is not None else None
        self.num_ubatches = num_ubatches  # the engine splits its steps into this many (`Exchange.num_ubatches`)
        self.groups = build_p2p_groups(world, topology, name, num_ubatches > 1)
        self.sync = topology.group("attention", self.attn_rank)
        self.device = device_for(world.backend)
        self.num_tokens: int | None = None  # this step's T, None outside a step
        self.slot_tokens: list[int] = []  # this step's rows per slot, as announced (m entries)
        self.num_split = 1  # micro-batches this step runs: 1 = the whole step in slot 0, through __call__
        self.num_sends = 0  # boundary sends of this step: send n is slot n % num_split, layer n // num_split
        self.pending: deque[PendingRows] = deque()  # sends whose answer was not taken yet, oldest first
        self.is_finished = False
        self.num_steps = 0
        self.wave_idle = False  # whether no replica had work in the last wave
        self.timeline = Timeline.from_env(f"p2p_attention{self.attn_rank}", self.device)  # AFD_TIMELINE=DIR

    def _dst(self, ffn_rank: int) -> int:
        return self.groups.data.group_rank(self.topology.world_rank("ffn", ffn_rank))

    def step_wave(self, has_work: bool, keep_alive: bool = False) -> bool:
        """All-reduce over attention replicas: True while any has work or wants the wave kept going (a
        serving replica, stepping with zero tokens); `wave_idle` says whether none had work. At the end,
        tell the FFN."""
        if self.is_finished:
            return False
        flags = torch.tensor([int(has_work), int(has_work or keep_alive)], dtype=torch.long)
        self.world.wait(self.groups.wave.pg.allreduce([flags]), "the DP wave all-reduce")
        self.wave_idle = int(flags[0]) == 0
        if int(flags[1]) > 0:
            return True
        self._send_ctrl(0, finished=True, slots=[0] * self.num_ubatches)
        self.is_finished = True
        if self.timeline is not None:
            self.timeline.dump()
        logger.info("%s: DP wave finished after %d steps", self.world.me.name, self.num_steps)
        return False

    def begin_step(self, num_tokens: int, ubatch_tokens: Sequence[int] | None = None) -> None:
        """Control plane: tell this step's token count to every FFN member of the sync group; with
        micro-batches also each slot's (`ubatch_tokens`: a step split into that many micro-batches, in order;
        None: the whole step in slot 0)."""
        if self.is_finished:
            raise RuntimeError(f"{self.world.me.name}: begin_step after the DP wave finished")
        self._check_step_end()
        if self.wave_idle and num_tokens:
            raise RuntimeError(f"{self.world.me.name}: a step of {num_tokens} tokens in a wave it said was idle")
        slots = self._slots(num_tokens, ubatch_tokens)
        self._send_ctrl(num_tokens, finished=False, slots=slots)
        self.num_tokens, self.slot_tokens, self.num_sends = num_tokens, slots, 0
        self.num_split = len(ubatch_tokens) if ubatch_tokens is not None else 1
        self.num_steps += 1

    def _slots(self, num_tokens: int, ubatch_tokens: Sequence[int] | None) -> list[int]:
        """Rows per slot [m]: the micro-batches' counts, then empty slots."""
        tokens = [num_tokens] if ubatch_tokens is None else [int(t) for t in ubatch_tokens]
        if not 1 <= len(tokens) <= self.num_ubatches or sum(tokens) != num_tokens or min(tokens) < 0:
            raise ValueError(
                f"{self.world.me.name}: micro-batches of {tokens} tokens do not split a step of {num_tokens} "
                f"tokens into at most {self.num_ubatches}"
            )
        return tokens + [0] * (self.num_ubatches - len(tokens))

    def _send_ctrl(self, num_tokens: int, finished: bool, slots: list[int]) -> None:
        words = [num_tokens, int(finished), int(self.wave_idle and not finished)]
        msg = torch.tensor(words + (slots if self.num_ubatches > 1 else []), dtype=torch.long)
        pg = self.groups.ctrl.pg
        works = [
            (pg.send([msg], self._dst(f), TAG_CTRL), f"sending the step count to ffn {f}") for f in self.sync.ffn_ranks
        ]
        self.world.wait_all(works)

    def _check_step_end(self) -> None:
        if self.num_tokens is not None and self.boundary_layers is not None:
            sent, expected = self.num_sends, self.num_split * len(self.boundary_layers)
            if sent != expected or self.pending:
                raise RuntimeError(
                    f"{self.world.me.name}: step ended after {sent} of {expected} boundary sends "
                    f"({len(self.pending)} answers not taken)"
                )

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        """x: [T, H] model dtype; routing: Routing (gate on attention) or None -> [T, H] model dtype."""
        if self.num_split != 1:
            raise RuntimeError(f"{self.world.me.name}: a step split into micro-batches exchanges through send/recv")
        self.send(layer_idx, x, routing)
        return self.recv()

    def send(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> PendingRows:
        """Post one boundary of the next micro-batch (slot `num_sends % num_split`): its fused rows to each FFN
        peer, and the receives of the answers; returns at once (`Exchange.send`).
        x: [n, H] model dtype; routing: Routing (gate on attention) or None."""
        self._check_layer(layer_idx, x, routing)
        if self.timeline is not None:
            self.timeline.mark("send", layer_idx)  # on the device: the layer's attention is done
        num_rows = x.shape[0]
        if len(self.sync.ffn_ranks) == 1:
            sends = [RowSend(self.attn_rank, self.sync.ffn_ranks[0], num_rows, 0, 0)]
        else:
            sends = attn_sends(self.topology, self.attn_rank, num_rows)
        pg, answers = self.groups.data.pg, self.groups.answers.pg
        pending = PendingRows(layer_idx, [], [], [])
        for s in sends:
            if s.num_rows == 0:
                continue
            rows = slice(s.attn_offset, s.attn_offset + s.num_rows)
            if routing is None:
                payload = x[rows].contiguous()  # [n, H]: already contiguous, no copy
            else:  # one message: weights, ids and rows packed (RowPayload)
                layout = RowPayload(x.shape[1], routing.topk_ids.shape[1], x.dtype)
                payload = layout.pack(x[rows], routing.topk_ids[rows], routing.topk_weights[rows])
            what = f"sending layer {layer_idx} rows to ffn {s.ffn_rank}"
            pending.works.append((pg.send([payload], self._dst(s.ffn_rank), TAG_ROWS), what))
            pending.payloads.append(payload)
        for s in sends:
            out = torch.empty(s.num_rows, x.shape[1], dtype=x.dtype, device=x.device)  # [n, H]
            if s.num_rows:
                what = f"receiving layer {layer_idx} output from ffn {s.ffn_rank}"
                pending.works.append((answers.recv([out], self._dst(s.ffn_rank), TAG_OUT), what))
            pending.outs.append(out)
        self.pending.append(pending)
        self.num_sends += 1
        if self.timeline is not None:
            self.timeline.mark("sent", layer_idx)  # on the device: the payloads are packed (NCCL sends them)
        return pending

    def recv(self) -> torch.Tensor:
        """Wait for the oldest send's transfers -> its answer [n, H] model dtype (`Exchange.recv`)."""
        if not self.pending:
            raise RuntimeError(f"{self.world.me.name}: recv without a send in flight")
        pending = self.pending.popleft()
        self.world.wait_all(pending.works)
        if self.timeline is not None:
            self.timeline.mark("reply", pending.layer_idx)  # on the device: the answers are in
        outs = pending.outs
        return torch.cat(outs) if len(outs) > 1 else outs[0]  # [n, H]

    def _check_layer(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> None:
        if self.num_tokens is None:
            raise RuntimeError(f"{self.world.me.name}: exchange called before begin_step")
        slot, index = self.num_sends % self.num_split, self.num_sends // self.num_split
        if x.shape[0] != self.slot_tokens[slot]:
            whole = self.num_split == 1
            raise RuntimeError(
                f"{self.world.me.name}: layer {layer_idx} got {x.shape[0]} rows, begin_step announced "
                + (f"{self.num_tokens}" if whole else f"{self.slot_tokens[slot]} for micro-batch {slot}")
            )
        if (routing is not None) != self.gate_on_attention:
            raise RuntimeError(f"routing must be given iff the gate is on attention (layer {layer_idx})")
        if self.boundary_layers is not None:
            expected = self.boundary_layers[index] if index < len(self.boundary_layers) else None
            if layer_idx != expected:
                raise RuntimeError(f"{self.world.me.name}: exchange called for layer {layer_idx}, expected {expected}")

    def close(self) -> None:
        """Drop the groups; the world itself is closed by its owner."""
        if not self.is_finished:
            logger.warning("%s: p2p exchange closed before the DP wave finished", self.world.me.name)
