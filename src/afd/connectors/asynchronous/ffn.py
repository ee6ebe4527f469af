"""The `async` connector's FFN side: a self-driven loop that pulls work items from its window (any layer, any
attention replica, any order), runs the items of one layer that wait together through one expert pass
(replayed from CUDA graphs at decode sizes when given them), and writes each answer back into its sender's
window. The protocol is in `afd.connectors.asynchronous.attention`; the endpoint both roles share in
`afd.connectors.asynchronous.endpoint`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from afd.connectors.asynchronous.endpoint import AsyncEndpoint, ConnectorShutdown
from afd.connectors.asynchronous.ffn_chain import PassChain
from afd.connectors.asynchronous.window import Message
from afd.connectors.asynchronous.wire import FLAG_RESPONSE, SlotHeader, WindowProtocolError
from afd.connectors.expert_pass import FFNModelLike, GraphedPass, WorkRows, expert_pass
from afd.topology import AsyncTopology, Role

logger = logging.getLogger("afd.connectors.asynchronous.attention")

CHAIN_POLL_S = 1e-3  # while passes are queued on the device, the host looks at them this often


class AsyncFFNServer(AsyncEndpoint):
    """FFN side: pulls work items from its window, computes local + shared experts, answers."""

    role: Role = "ffn"

    def __init__(
        self,
        store: dist.Store,
        topology: AsyncTopology,
        ffn_rank: int,
        *,
        expert_graphs: GraphedPass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(store, topology, ffn_rank, **kwargs)  # closes its window itself if it fails
        self.expert_graphs = expert_graphs  # replayed expert passes at decode sizes (afd.engine.graphs.ffn), or None
        self.items_served = 0
        self.expert_passes = 0  # fewer than items_served when items of one layer were served together
        self.chains: dict[
            int, PassChain
        ] = {}  # attention rank -> its device-driven passes (afd.connectors.asynchronous.ffn_chain)
        self._chain_decided = False

    def chain_to(self, ffn_model: FFNModelLike, graphs_usable: bool = False) -> bool:
        """Serve whole passes on the device where that applies: one attention rank, one FFN rank, one ring stage,
        on CUDA with device-side waits and `graphs_usable` (the FFN model's expert passes can be captured,
        `ExpertPassGraphs.usable`), on CPU only with `connector_extra_config.cpu_device_passes` (tests). Builds and
        captures them now, before the first request is served. Returns whether it did; decided once."""
        if self._chain_decided:
            return bool(self.chains)
        self._chain_decided = True
        replicas = self.topology.num_attention
        if self.device.type == "cuda":
            usable = self.window.device_waits and graphs_usable
        else:
            usable = self.config.cpu_device_passes
        if not (usable and replicas == 1 and self.topology.num_ffn == 1 and not self.config.async_moe_ubatching):
            return False
        config = getattr(ffn_model, "config", None)
        layers = getattr(ffn_model, "layers", None)
        if config is not None and layers is not None:
            moe_layers = [int(i) for i in layers if config.is_moe_layer(int(i))]
        else:
            moe_layers = list(range(self.num_layers))
        for region in range(replicas):
            chain = PassChain(
                self.window, region, self.peer_world(region), self.role_rank, ffn_model, moe_layers,
                timeout_s=self.timeout_s,
            )  # fmt: skip
            chain.capture_all()
            self.chains[region] = chain
        return True

    def step(self, ffn_model: FFNModelLike, max_items: int | None = None) -> int:
        """Serve up to `max_items` (default num_layers) work items; returns early on a poll timeout.

        Every poll takes all the items waiting at that moment; those of one layer go through one
        expert pass. Raises ConnectorShutdown once every attention rank has announced shutdown,
        PeerDied if one is gone without it. No device synchronize: ordering is the stream's.
        """
        limit = max_items if max_items is not None else self.num_layers
        served = 0
        while served < limit:
            for chain in self.chains.values():
                if chain.owns_slot:
                    chain.retire()
            skip = {c.slot_index for c in self.chains.values() if c.owns_slot} or None
            msgs = self.window.poll_many(CHAIN_POLL_S if skip else self.poll_timeout_s, limit - served, skip=skip)
            if not msgs:  # (passes queued: polls are short, the liveness check keeps its own period)
                if skip is None or time.monotonic() - self._last_liveness > self.poll_timeout_s:
                    self.check_peers_alive()
                break
            work = [m for m in msgs if not m.header.is_shutdown]
            if self.chains:  # a chain's slot: this pass and the next ones go to the device
                chained = [m for m in work if m.stage == 0 and self._chained(m)]
                work = [m for m in work if all(m is not c for c in chained)]
                served += len(chained)
            if work:
                self._serve(ffn_model, work)
                served += len(work)
            for msg in msgs:
                if msg.header.is_shutdown:
                    self.peers_closed.add(msg.region)
                    logger.debug("FFN rank %d: attention rank %d shut down", self.role_rank, msg.region)
            if len(self.peers_closed) == self.num_peers:
                raise ConnectorShutdown("every attention rank announced shutdown")
        if time.monotonic() - self._last_liveness > max(1.0, self.poll_timeout_s):
            self.check_peers_alive()
        return served

    def _serve(self, ffn_model: FFNModelLike, msgs: list[Message]) -> None:
        """Answer work items: one expert pass per layer among them, one reply per item."""
        if self.timeline is not None:
            for msg in msgs:  # the host read their flags and headers just now
                self.timeline.mark("found", msg.header.layer_idx, on_device=False)
        by_layer: dict[int, list[Message]] = {}
        for msg in msgs:
            h = msg.header
            if h.is_response or not 0 <= h.layer_idx < self.num_layers or msg.region >= self.topology.num_attention:
                raise WindowProtocolError(
                    f"FFN rank {self.role_rank} got a malformed work item from region {msg.region} (layer "
                    f"{h.layer_idx}, flags {h.flags})"
                )
            by_layer.setdefault(h.layer_idx, []).append(msg)
        for layer_idx, group in by_layer.items():
            items = [WorkRows(m.rows, m.topk_ids, m.topk_weights, m.header.shared_rows) for m in group]
            if self.timeline is not None:
                self.timeline.mark("pass", layer_idx)
            outs = expert_pass(ffn_model, layer_idx, items, self.expert_graphs)  # [R_i, H] fp32 each
            self.expert_passes += 1
            for msg, out in zip(group, outs, strict=True):
                h = msg.header
                reply = SlotHeader(
                    layer_idx=h.layer_idx,
                    num_tokens=h.num_tokens,
                    num_rows=h.num_rows,
                    shared_rows=h.shared_rows,
                    echo_seq=h.seq,
                    flags=FLAG_RESPONSE,
                )
                self.window.write_slot(
                    self.peer_world(msg.region), self.role_rank, msg.stage, reply, rows=out, seq=h.seq
                )
            self.items_served += len(group)
            if self.timeline is not None:
                self.timeline.mark("answered", layer_idx)  # on the device: the replies and their flags are written

    def _chained(self, msg: Message) -> bool:
        """Whether the sender's chain took this request (and the rest of its pass) to the device."""
        chain = self.chains.get(msg.region)
        return chain is not None and chain.start(msg.header.layer_idx, msg.header.num_rows)

    def close(self) -> None:
        """Fail the passes still queued on the device (their waits would never end), then close as every rank."""
        if self.chains and not self._closed:
            for chain in self.chains.values():
                chain.release()
            logger.info(
                "FFN rank %d: %d work items served on the device in whole passes, %d passes handed back to the host",
                self.role_rank,
                sum(c.items_served for c in self.chains.values()),
                sum(c.aborts for c in self.chains.values()),
            )
        super().close()

    @torch.inference_mode()
    def serve(self, ffn_model: FFNModelLike, stop_event: threading.Event | None = None) -> None:
        """Run until every attention rank shut down (normal return) or `stop_event` is set."""
        self.chain_to(ffn_model)
        try:
            while stop_event is None or not stop_event.is_set():
                self.step(ffn_model)
        except ConnectorShutdown as e:
            logger.info(
                "FFN rank %d: %s after %d work items in %d expert passes",
                self.role_rank,
                e,
                self.items_served,
                self.expert_passes,
            )


def run_ffn_loop(server: AsyncFFNServer, ffn_model: FFNModelLike, stop_event: threading.Event | None = None) -> None:
    """The self-driven FFN loop; closes the server (announcing shutdown) on the way out."""
    try:
        server.serve(ffn_model, stop_event)
    finally:
        server.close()
