"""CUDA graphs for an FFN rank's expert pass at decode sizes, and at prefill sizes up to the token budget.

Why: an FFN rank's host launches every kernel of a layer's expert pass — the fused MoE's kernels, the shared
experts' MLP, the adds — about ten launches, and a Triton launch from Python alone costs 20-40 us of host time.
The async connector's FFN rank pays that on its critical path at every layer: it discovers a message by
polling, then launches. One replay per (layer, row bucket) is one launch.

A graph computes, on static buffers of `n` (bucket) rows: the routed experts' weighted sum over each row's own
(row, k) pairs (`FFNModel.experts_topk`, the fixed-shape path: no host sync) plus the shared experts on the
rows a static mask marks, in fp32. Padding rows hold zeros with weight 0 and add nothing to real rows (every
op is row-wise), so one graph serves every row count up to its bucket. Padding rows route to expert id -1, which
no rank holds: their pairs sort after every group and cost no expert FLOPs.

Prefill sizes (`max_rows`: the buckets of `afd.engine.graphs.decode.token_buckets` above the decode ones) matter because
the FFN host spent 0.7-1.2 ms enqueueing a 2,048-4,096-row pass that the GPU ran in 1.0-1.5 ms, so
two micro-batches left the FFN host-bound. Their graphs write one shared fp32 output buffer (a copy inside the
graph) instead of keeping an output per (layer, bucket), which at these sizes would be gigabytes.
A GEMM over a bucket may tile differently than over the real rows: a row's result may move by float rounding,
as when replicas' items are batched (`afd.connectors.expert_pass`).

Graphs never replay concurrently (one FFN rank, one stream), so they share one memory pool, and the output
buffer of a bucket is reused by the next replay: `run`'s result must be consumed (copied out, on the same
stream) before the next call. `capture=False` runs the padded computation eagerly (CPU tests of the padding).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from afd.buckets import DEFAULT_BATCH_BUCKETS, pick_bucket, token_buckets
from afd.engine.graphs.decode import capture_safe_moe
from afd.routing import Routing

logger = logging.getLogger(__name__)


class ExpertPassGraphs:
    """Replays one layer's expert pass (routed + shared experts, fp32 out) for up to `max(buckets)` rows."""

    def __init__(
        self,
        ffn_model: torch.nn.Module,
        buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
        *,
        capture=True,
        max_rows: int | None = None,
    ):
        self.ffn_model = ffn_model
        decode = sorted(buckets)
        above = decode[-1] if decode else 0
        prefill = [b for b in token_buckets(max_rows) if b > above] if max_rows and max_rows > above else []
        self.buckets = decode + prefill
        if not self.buckets:
            raise ValueError("an expert-pass graph set needs at least one bucket")
        self.capture = capture
        config = ffn_model.config
        param = next(ffn_model.parameters())
        n, hidden, k = self.buckets[-1], config.hidden_size, config.num_experts_per_tok
        self.device, self.dtype = param.device, ffn_model.dtype  # the compute dtype (weights may be FP8)
        self.moe_layers = [int(i) for i in ffn_model.layers if config.is_moe_layer(int(i))]
        self._x = torch.zeros(n, hidden, dtype=self.dtype, device=self.device)  # [n, H]
        self._ids = torch.zeros(n, k, dtype=torch.long, device=self.device)  # [n, K]
        self._weights = torch.zeros(n, k, dtype=torch.float32, device=self.device)  # [n, K]
        self._shared = torch.zeros(n, dtype=torch.bool, device=self.device)  # [n]: rows through the shared experts
        self._out: dict[tuple[int, int], torch.Tensor] = {}  # (layer, bucket) -> [bucket, H] fp32 (graph output)
        self._shared_out_above = above  # buckets above this write `_prefill_out`, shared by every layer
        self._prefill_out = torch.zeros(n, hidden, dtype=torch.float32, device=self.device) if prefill else None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @staticmethod
    def usable(ffn_model: torch.nn.Module) -> bool:
        """CUDA, and routed experts on the fixed-shape, host-sync-free path."""
        param = next(ffn_model.parameters(), None)
        return param is not None and param.is_cuda and capture_safe_moe(ffn_model)

    def _compute(self, layer_idx: int, n: int) -> torch.Tensor:
        """The expert pass over the first `n` static rows: [n, H] fp32."""
        x = self._x[:n]
        out = self.ffn_model.experts_topk(layer_idx, x, Routing(self._ids[:n], self._weights[:n])).float()
        if not self.ffn_model.has_shared_experts:  # the attention ranks run them
            return out
        shared = self.ffn_model.shared(layer_idx, x).float()  # [n, H]
        return out + torch.where(self._shared[:n, None], shared, 0.0)

    def _capture(self, key: tuple[int, int]) -> None:
        layer_idx, n = key
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile and allocate outside the capture
            self._compute(layer_idx, n)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._out[key] = self._output(n, self._compute(layer_idx, n))
        self._graphs[key] = graph

    def _output(self, n: int, out: torch.Tensor) -> torch.Tensor:
        """Where bucket `n`'s result lives: its own buffer (decode sizes) or the shared prefill one (a copy)."""
        return out if n <= self._shared_out_above else self._prefill_out[:n].copy_(out)

    def capture_all(self) -> None:
        """Capture every (MoE layer, bucket) now, before any timed work; logs how long it took."""
        if not self.capture:
            return
        start = time.perf_counter()
        with torch.inference_mode():
            for layer_idx in self.moe_layers:
                for n in self.buckets:
                    if (layer_idx, n) not in self._graphs:
                        self._capture((layer_idx, n))
        torch.cuda.synchronize(self.device)
        logger.info(
            "FFN expert-pass CUDA graphs: %d layers x buckets %s captured in %.1f s",
            len(self.moe_layers),
            self.buckets,
            time.perf_counter() - start,
        )

    def run(
        self,
        layer_idx: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: Sequence[tuple[int, int]],
    ) -> torch.Tensor | None:
        """The expert pass of `x [R, H]` (rows `start:start + count` of every `(start, count)` in `shared` also
        through the shared experts) as `[R, H]` fp32, a view of the graph's output (consume it before the next
        call); None when no bucket holds R rows or the layer has no routed experts here (run it eagerly)."""
        rows = x.shape[0]
        n = pick_bucket(rows, self.buckets)
        if n is None or layer_idx not in self.moe_layers:
            return None
        self._x[:rows].copy_(x)
        self._x[rows:n].zero_()
        self._ids[:rows].copy_(topk_ids)
        self._ids[rows:n].fill_(-1)  # no rank's expert: padding pairs cost nothing
        self._weights[:rows].copy_(topk_weights)
        self._weights[rows:n].zero_()
        self._shared[:n].zero_()
        for start, count in shared:
            self._shared[start : start + count].fill_(True)
        if not self.capture:
            return self._output(n, self._compute(layer_idx, n))[:rows]
        key = (layer_idx, n)
        if key not in self._graphs:
            self._capture(key)
        self._graphs[key].replay()
        return self._out[key][:rows]
