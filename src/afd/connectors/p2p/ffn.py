"""The p2p connector's FFN side: one FFN rank serving the DP wave — per step the control messages of its
attention peers, then per boundary layer (and micro-batch slot) the fused rows in, the expert-parallel MoE over
the FFN ranks, the answers back. The protocol is in `afd.connectors.p2p.attention`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from afd.connectors.expert_pass import GraphedPass
from afd.connectors.p2p.attention import CTRL_LEN, TAG_CTRL, TAG_OUT, TAG_ROWS, build_p2p_groups, ctrl_len
from afd.connectors.p2p.wire import EpDispatch, RowPayload, RowSend, ffn_recvs, plan_ep_dispatch
from afd.distributed.world import World, device_for
from afd.profiling.timeline import Timeline
from afd.routing import Routing
from afd.topology import SyncTopology, expert_ranges

logger = logging.getLogger("afd.connectors.p2p.attention")


class FFNModelLike(Protocol):
    """The part of afd.model.ffn_side.FFNModel the FFN loop uses (docs/architecture.md)."""

    def route(self, layer_idx: int, x: torch.Tensor) -> Any: ...
    def dense(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor: ...
    def experts(self, layer_idx: int, x_grouped: torch.Tensor, group_sizes: list[int]) -> torch.Tensor: ...
    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor | None: ...


class P2pFFNLoop:
    """One FFN rank serving the DP wave: per step, per boundary layer, recv -> EP MoE -> send back.

    `ffn_model` holds routed experts `expert_ranges(num_experts, F)[ffn_rank]` plus the shared
    experts (plus gate and dense MLPs when the gate is on FFN). `run()` returns when the attention
    replicas report the wave finished.
    """

    def __init__(
        self,
        world: World,
        topology: SyncTopology,
        ffn_model: FFNModelLike,
        *,
        num_experts: int,
        topk: int,
        hidden_size: int,
        dtype: torch.dtype,
        boundary_layers: Sequence[int],
        gate_on_attention: bool,
        dense_layers: Collection[int] = (),
        num_ubatches: int = 1,
        expert_graphs: GraphedPass | None = None,
        name: str = "p2p",
    ) -> None:
        if world.me.role != "ffn":
            raise ValueError(f"{world.me.name} is not an FFN rank")
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be at least 1, got {num_ubatches}")
        if num_experts < topology.num_ffn:
            raise ValueError(f"{num_experts} routed experts cannot be spread over {topology.num_ffn} FFN ranks")
        if dense_layers and gate_on_attention:
            raise ValueError("dense layers run on the attention side when the gate is on attention")
        self.world, self.topology, self.ffn_rank = world, topology, world.me.role_rank
        self.model, self.num_experts, self.topk = ffn_model, num_experts, topk
        self.hidden_size, self.dtype = hidden_size, dtype
        self.boundary_layers, self.dense_layers = list(boundary_layers), set(dense_layers)
        self.gate_on_attention = gate_on_attention
        self.num_ubatches = num_ubatches  # slots served per step and boundary layer (the attention side's m)
        # one FFN rank: the MoE of a decode-sized layer replayed from a CUDA graph (afd.engine.graphs.ffn), or None
        self.expert_graphs = expert_graphs if topology.num_ffn == 1 else None
        self.groups = build_p2p_groups(world, topology, name, num_ubatches > 1)
        self.sync = topology.group("ffn", self.ffn_rank)
        self.local_experts = expert_ranges(num_experts, topology.num_ffn)[self.ffn_rank]
        self.device = device_for(world.backend)
        self.num_steps = 0
        self.num_slots_served = 0  # slots served over all busy steps, each through every boundary layer
        self.wave_idle = False  # no replica had work in this step's wave: no layer crosses
        self.timeline = Timeline.from_env(f"p2p_ffn{self.ffn_rank}", self.device)  # AFD_TIMELINE=DIR

    def _src(self, attn_rank: int) -> int:
        return self.groups.data.group_rank(self.topology.world_rank("attention", attn_rank))

    def run(self) -> int:
        """Serve steps until the wave finishes; returns the number of steps served."""
        while self.step():
            pass
        if self.timeline is not None:
            self.timeline.dump()
        logger.info("%s: DP wave finished after %d steps", self.world.me.name, self.num_steps)
        return self.num_steps

    def step(self) -> bool:
        """One engine step of every peer; False once they report the wave finished. Per boundary layer the
        slots (micro-batches) in the order the attention ranks send them: slot 0..m-1."""
        slots = self._recv_counts()
        if slots is None:
            return False
        if not self.wave_idle:  # every FFN rank sees the same bit, so all skip the expert all-to-all together
            slots = slots[: self._slots_in_use(slots)]
            for layer_idx in self.boundary_layers:
                for counts in slots:
                    self._layer(layer_idx, counts)
            self.num_slots_served += len(slots)
        self.num_steps += 1
        return True

    def _slots_in_use(self, slots: list[dict[int, int]]) -> int:
        """How many slots this step serves: past the wave's last non-empty slot no rank sends anything (a whole
        step, such as a graphed decode, fills slot 0 alone). Every FFN rank must serve as many (each slot is an
        expert all-to-all), so with several they agree on the largest: one gloo all-reduce per step."""
        used = max((i + 1 for i, counts in enumerate(slots) if any(counts.values())), default=1)
        if self.groups.ffn_wave is None:
            return used
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        agreed = torch.tensor([used], dtype=torch.long)
        self.world.wait(self.groups.ffn_wave.pg.allreduce([agreed], opts), "agreeing on the micro-batch slots in use")
        return int(agreed[0])

    def _recv_counts(self) -> list[dict[int, int]] | None:
        """Per-peer control messages -> per slot {attn_rank: num_tokens} (one slot without micro-batches), or
        None when the wave is finished."""
        pg = self.groups.ctrl.pg
        msgs = {a: torch.zeros(ctrl_len(self.num_ubatches), dtype=torch.long) for a in self.sync.attn_ranks}
        self.world.wait_all(
            [
                (pg.recv([m], self._src(a), TAG_CTRL), f"receiving step {self.num_steps} count from attention {a}")
                for a, m in msgs.items()
            ]
        )
        finished = {a for a, m in msgs.items() if int(m[1])}
        if finished and len(finished) != len(msgs):
            raise RuntimeError(
                f"{self.world.me.name}: attention ranks {sorted(finished)} ended the wave, "
                f"others did not (step {self.num_steps})"
            )
        self.wave_idle = all(int(m[2]) for m in msgs.values())
        if finished:
            return None
        if self.num_ubatches == 1:
            return [{a: int(m[0]) for a, m in msgs.items()}]
        for a, m in msgs.items():
            if int(m[CTRL_LEN:].sum()) != int(m[0]):
                raise RuntimeError(
                    f"{self.world.me.name}: attention {a} announced {int(m[0])} tokens in micro-batches of "
                    f"{m[CTRL_LEN:].tolist()} (step {self.num_steps})"
                )
        return [{a: int(m[CTRL_LEN + i]) for a, m in msgs.items()} for i in range(self.num_ubatches)]

    def _recv_rows(self, layer_idx: int, recvs: list[RowSend]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One fused message per spoke, sized from the control plane -> x [N, H], ids [N, K] int64 and
        weights [N, K] fp32 (both [N, 0] when the gate is on FFN), spokes concatenated in order."""
        layout = RowPayload(self.hidden_size, self.topk if self.gate_on_attention else 0, self.dtype)
        pg, works, parts = self.groups.data.pg, [], []
        for s in recvs:
            if s.num_rows == 0:
                continue
            buf = torch.empty(layout.nbytes(s.num_rows), dtype=torch.uint8, device=self.device)
            what = f"receiving layer {layer_idx} rows from attention {s.attn_rank}"
            works.append((pg.recv([buf], self._src(s.attn_rank), TAG_ROWS), what))
            parts.append(layout.unpack(buf, s.num_rows))
        self.world.wait_all(works)
        if not parts:
            parts.append(layout.unpack(torch.empty(0, dtype=torch.uint8, device=self.device), 0))
        x, ids, weights = (p[0] if len(p) == 1 else torch.cat(p) for p in zip(*parts, strict=True))
        return x, ids.long(), weights

    def _layer(self, layer_idx: int, counts: Mapping[int, int]) -> None:
        recvs = ffn_recvs(self.topology, self.ffn_rank, counts)
        num_rows = sum(s.num_rows for s in recvs)
        if num_rows == 0 and self.topology.num_ffn == 1:
            return  # nothing arrives, nothing goes back, and no expert all-to-all waits for this rank (empty slot)
        timeline = self.timeline
        if timeline is not None:
            timeline.mark("found", layer_idx, on_device=False)  # the host posts the layer's receives
        x, ids, weights = self._recv_rows(layer_idx, recvs)  # [N, H], [N, K], [N, K]
        if timeline is not None:
            timeline.mark("pass", layer_idx)  # on the device: the rows are in
        pg = self.groups.answers.pg

        if not self.gate_on_attention and layer_idx in self.dense_layers:
            out = self.model.dense(layer_idx, x) if num_rows else torch.zeros_like(x)  # [N, H]
        else:
            if not self.gate_on_attention and num_rows:
                routing = self.model.route(layer_idx, x)
                ids, weights = routing.topk_ids.to(torch.long), routing.topk_weights.float()
            out = self._moe(layer_idx, x, ids, weights)
        if timeline is not None:
            timeline.mark("answered", layer_idx)  # on the device: computed (NCCL sends it next)

        works = [
            (
                pg.send([out[s.ffn_offset : s.ffn_offset + s.num_rows].contiguous()], self._src(s.attn_rank), TAG_OUT),
                f"sending layer {layer_idx} output to attention {s.attn_rank}",
            )
            for s in recvs
            if s.num_rows
        ]
        self.world.wait_all(works)

    def _moe(self, layer_idx: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H], ids/weights: [N, K] -> [N, H]; joins the EP all-to-all even when N == 0."""
        if self.topology.num_ffn == 1:
            if self.expert_graphs is not None and x.shape[0]:  # routed + shared experts in one replay
                replayed = self.expert_graphs.run(layer_idx, x, ids, weights, [(0, x.shape[0])])  # [N, H] fp32
                if replayed is not None:
                    return replayed.to(x.dtype, copy=True)  # a copy: the graph's output is reused by the next replay
            # every expert is local: no all-to-all, and the reference's own routed path (no host sync on CUDA bf16)
            acc = self.model.experts_topk(layer_idx, x, Routing(ids, weights))  # [N, H] fp32
        else:
            plan = plan_ep_dispatch(ids, weights, self.num_experts, self.topology.num_ffn)
            send_rows = x[plan.token]  # [P, H], sorted by (owner, local expert)
            back = self._expert_all_to_all(layer_idx, plan, send_rows)  # [P, H]
            acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [N, H] fp32
            acc.index_add_(0, plan.token, back.float() * plan.weight[:, None])
        if x.shape[0]:
            shared = self.model.shared(layer_idx, x)
            if shared is not None:
                acc += shared.float()
        return acc.to(x.dtype)

    def _expert_all_to_all(self, layer_idx: int, plan: EpDispatch, send_rows: torch.Tensor) -> torch.Tensor:
        """send_rows: [P, H] by (owner, local expert) -> their expert outputs [P, H], computed by the owners."""
        ep, num_ffn = self.groups.ep, self.topology.num_ffn
        what = f"layer {layer_idx} expert all-to-all"
        max_local = plan.counts.shape[1]
        recv_counts = torch.empty_like(plan.counts)  # [F_src, max_local]
        self.world.wait(
            ep.pg.alltoall_base(
                recv_counts.view(-1), plan.counts.view(-1).contiguous(), [max_local] * num_ffn, [max_local] * num_ffn
            ),
            what + " (counts)",
        )
        # The layer's one host copy, for both directions: the all-to-all takes its split sizes as host lists,
        # and how many pairs go to each owner depends on this layer's routing, which no control message
        # knows in advance. Everything below reuses it; nothing else is read back.
        sent_host, host_counts = torch.stack([plan.counts, recv_counts]).cpu()
        send_splits, recv_splits = sent_host.sum(1).tolist(), host_counts.sum(1).tolist()
        num_recv = sum(recv_splits)

        recv_rows = send_rows.new_empty(num_recv, send_rows.shape[1])  # [R, H], by (source, local expert)
        self.world.wait(ep.pg.alltoall_base(recv_rows, send_rows, recv_splits, send_splits), what + " (rows)")

        # Regroup by local expert across sources for the grouped expert call, on the device (no host copy).
        cells = torch.arange(max_local, device=send_rows.device).repeat(num_ffn)  # [F * max_local]
        local = cells.repeat_interleave(recv_counts.view(-1), output_size=num_recv)  # [R]
        perm = torch.argsort(local, stable=True)  # [R]
        group_sizes = host_counts.sum(0)[: len(self.local_experts)].tolist()
        expert_out = torch.empty_like(recv_rows)  # [R, H]
        if recv_rows.shape[0]:
            expert_out[perm] = self.model.experts(layer_idx, recv_rows[perm], group_sizes).to(send_rows.dtype)

        back = send_rows.new_empty(send_rows.shape)  # [P, H]
        self.world.wait(ep.pg.alltoall_base(back, expert_out, send_splits, recv_splits), what + " (results)")
        return back

    def close(self) -> None:
        """Nothing to release beyond the world's groups; present for symmetry with other connectors."""
