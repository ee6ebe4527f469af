"""DeepSeek-V2/V3 split at the MoE boundary: the attention side's layers and model.

The FFN side (`FFNModel`: routed experts of a range, shared experts) lives in `afd.model.ffn_side`; the config in
`afd.model.config`, the shared blocks in `afd.model.layers`, MLA in `afd.model.attention`.

Numerics follow the `transformers` DeepseekV2/V3 implementation (the oracle in tests). The attention
side never calls expert weights: a boundary layer hands `(layer_idx, x, routing)` to an `exchange`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from afd.connectors.base import Exchange, ZeroExchange
from afd.model.attention import MLAttention
from afd.model.batch import Batch
from afd.model.config import MODEL_TYPES, ModelConfig, rope_parameters, scaled, softmax_scale
from afd.model.kv_cache import PagedLatentCache
from afd.model.layers import MLP, Gate, RMSNorm, apply_rope
from afd.routing import Routing

logger = logging.getLogger(__name__)

# The model's public names, wherever they are defined (callers import them from here).
__all__ = [
    "MODEL_TYPES",
    "MLP",
    "AttentionCore",
    "AttentionLayer",
    "AttentionModel",
    "Batch",
    "Boundary",
    "Exchange",
    "Gate",
    "MLAttention",
    "ModelConfig",
    "RMSNorm",
    "apply_rope",
    "rope_parameters",
    "run_segments",
    "run_ubatches",
    "split_ubatches",
    "zero_exchange",
]


@dataclass
class Boundary:
    """What a boundary layer hands to the FFN side: `hidden [T, H]` (post-attention-normed) and its routing
    (None when the gate runs on the FFN side)."""

    layer_idx: int
    hidden: torch.Tensor
    routing: Routing | None


@dataclass
class AttentionCore:
    """Where `forward_segments(pause_at_attention=True)` stops inside a layer: its row-wise projections are done
    (q [T, nh, D], this step's latents kv_c [T, C], k_pe [T, R], already cached); the caller runs the
    layout-dependent core (`MLAttention.attend`) and resumes with its output [T, nh, Dv]."""

    layer_idx: int
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor


# AttentionModel.forward_segments (AttentionCore pauses only with pause_at_attention=True)
Segments = Generator[Boundary | AttentionCore, torch.Tensor, torch.Tensor]


# An exchange that never crosses to the FFN side (graph capture, warm-up): answers zeros [T, H].
zero_exchange = ZeroExchange()


def run_segments(segments: Segments, exchange: Exchange) -> torch.Tensor:
    """Drive a `forward_segments` generator to its end, answering every boundary through `exchange`."""
    try:
        boundary = next(segments)
        while True:
            boundary = segments.send(exchange(boundary.layer_idx, boundary.hidden, boundary.routing))
    except StopIteration as end:
        return end.value


def split_ubatches(query_lens: Sequence[int], num_ubatches: int) -> list[range]:
    """Split a step's sequences into `min(num_ubatches, len(query_lens))` micro-batches of consecutive
    sequences with balanced token counts; a sequence is never split (its tokens attend to each other).

    Cut k goes where the running token count is closest to `k * T / m` (within what keeps every group
    non-empty), so no group holds more than `T / m + max(query_lens)` tokens: at most twice the best split,
    for one pass over the lengths. Consecutive groups keep the step's row order, so their hidden states
    concatenate back into it.
    """
    n = len(query_lens)
    if n == 0:
        return []
    m = max(1, min(num_ubatches, n))
    prefix = [0, *itertools.accumulate(query_lens)]  # prefix[i]: tokens of the first i sequences
    total = prefix[-1]
    cuts = [0]
    for k in range(1, m):
        lo, hi = cuts[-1] + 1, n - (m - k)  # leave at least one sequence for this group and each later one
        target = k * total / m
        i = min(max(bisect.bisect_left(prefix, target, lo, hi + 1), lo), hi)  # first cut at or past the target
        if i > lo and target - prefix[i - 1] <= prefix[i] - target:
            i -= 1  # the cut just before the target is as close or closer
        cuts.append(i)
    cuts.append(n)
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def run_ubatches(segments: Sequence[Segments], exchange: Exchange) -> list[torch.Tensor]:
    """Drive the `forward_segments` generators of a step's micro-batches in ping-pong; returns each one's
    final hidden states, in the order given. `exchange` splits its boundaries (`Exchange.send` / `recv`).

    Every micro-batch runs to its first boundary and is sent; then the oldest send is received, its
    micro-batch resumes up to its next boundary and is sent again, and so on. While one micro-batch
    computes its attention, the others' rows are on the wire or in the FFN ranks' experts. The exchange
    answers in send order, and so does the queue of micro-batches waiting here.
    """
    outputs: list[torch.Tensor | None] = [None] * len(segments)
    in_flight: deque[int] = deque()  # micro-batches whose boundary was sent, oldest first

    def advance(i: int, answer: torch.Tensor | None) -> None:
        try:
            boundary = next(segments[i]) if answer is None else segments[i].send(answer)
        except StopIteration as end:
            outputs[i] = end.value
            return
        exchange.send(boundary.layer_idx, boundary.hidden, boundary.routing)
        in_flight.append(i)

    for i in range(len(segments)):
        advance(i, None)
    while in_flight:
        advance(in_flight.popleft(), exchange.recv())
    return outputs  # type: ignore[return-value]  # every generator has returned


class AttentionLayer(nn.Module):
    """Attention side of one decoder layer: norms, attention, and the gate or dense MLP it owns (and, when asked,
    the shared experts of a MoE layer, which the connector runs while the FFN side computes the routed ones)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        gate_on_attention: bool,
        dtype: torch.dtype,
        shared_experts: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_idx, softmax_scale(config))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        is_moe = config.is_moe_layer(layer_idx)
        block = config.fp8_block
        has_mlp = gate_on_attention and not is_moe
        self.mlp = MLP(config.hidden_size, config.intermediate_size, block) if has_mlp else None
        rsf = 1.0 if dtype == torch.float16 else config.routed_scaling_factor
        self.gate = Gate(config, rsf) if gate_on_attention and is_moe else None
        shared_size = config.moe_intermediate_size * config.n_shared_experts
        has_shared = shared_experts and gate_on_attention and is_moe and shared_size > 0
        self.shared_experts = MLP(config.hidden_size, shared_size, block) if has_shared else None
        self.scale = config.residual_scale(dtype)

    def attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv_cache: PagedLatentCache | None
    ) -> tuple[torch.Tensor, Boundary | None]:
        """Everything of the layer on this side: the residual after attention (and after the dense MLP when
        this side owns it) [T, H], and what crosses to the FFN side (None when nothing does)."""
        return self.finish(x, self.self_attn.attend(*self.project(x, cos, sin, batch, kv_cache), batch, kv_cache))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv_cache: PagedLatentCache | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's row-wise part on the layer input x [T, H]: q, kv_c, k_pe (`MLAttention.project`)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin, batch, kv_cache)

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, Boundary | None]:
        """The rest of the layer from the attention core's output [T, nh, Dv]: as `attend` returns."""
        h = x + scaled(self.self_attn.o_proj(attention.flatten(1)), self.scale)
        y = self.post_attention_layernorm(h)  # [T, H]
        if self.mlp is not None:
            return h + scaled(self.mlp(y), self.scale), None
        return h, Boundary(self.layer_idx, y, self.gate(y) if self.gate is not None else None)


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """`nn.Embedding`, initialized only on a real device. Models are built on meta before their weights load, and
    `normal_` on a meta tensor first imports ~900 modules (sympy, mpmath): 2 s of every launcher's and attention
    rank's start on a small host, for values that are overwritten anyway."""
    weight = torch.empty(num_embeddings, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(num_embeddings, dim, _weight=weight)


class AttentionModel(nn.Module):
    """Embedding, attention blocks, norms, gate/dense MLPs (gate on attention), final norm, lm_head."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        gate_on_attention: bool = True,
        dtype: torch.dtype = torch.float32,
        shared_experts: bool = False,
    ) -> None:
        super().__init__()
        self.config, self.gate_on_attention, self.dtype = config, gate_on_attention, dtype
        # whether this side holds the shared experts of its MoE layers (the connector runs them between send and recv)
        self.has_shared_experts = shared_experts and gate_on_attention and config.n_shared_experts > 0
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            AttentionLayer(config, i, gate_on_attention, dtype, shared_experts) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.scale = config.residual_scale(dtype)
        self._rope: tuple[torch.Tensor, float] | None = None

    @property
    def boundary_layers(self) -> list[int]:
        """Layers whose MLP crosses to the FFN side."""
        if self.gate_on_attention:
            return self.config.moe_layers
        return list(range(self.config.num_hidden_layers))

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """Shared experts of a boundary layer on its normed hidden `x [T, H]` -> `[T, H]` model dtype, scaled as the
        FFN side scales them. Raises when this side does not hold them."""
        mlp = self.layers[layer_idx].shared_experts
        if mlp is None:
            raise ValueError(f"layer {layer_idx}'s shared experts are not on the attention side")
        return scaled(mlp(x), self.scale)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R/2] fp32 (already multiplied by the YaRN attention factor)."""
        if self._rope is None or self._rope[0].device != positions.device:
            inv_freq, attention_factor, _ = rope_parameters(self.config)
            self._rope = (inv_freq.to(positions.device), attention_factor)
        inv_freq, attention_factor = self._rope
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
        return freqs.cos() * attention_factor, freqs.sin() * attention_factor

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        exchange: Exchange,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden [T, H] model dtype."""
        if batch.num_tokens != input_ids.shape[0]:
            raise ValueError(f"batch covers {batch.num_tokens} tokens but {input_ids.shape[0]} were given")
        if kv_cache is not None and batch.slot_mapping is None:  # a caller that did not prepare the step
            kv_cache.prepare(batch)
        return run_segments(self.forward_segments(input_ids, positions, batch, kv_cache), exchange)

    def forward_segments(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        *,
        pause_at_attention: bool = False,
    ) -> Segments:
        """The forward pass, paused at every boundary layer: yields what crosses to the FFN side and resumes
        with the FFN side's answer [T, H]. Why a generator: a CUDA graph can capture each piece between two
        exchanges (afd.engine.graphs.decode) while the exchange itself, which crosses processes, runs eagerly.
        `pause_at_attention`: also pause in every layer at its attention core (`AttentionCore`), which
        depends on the step's layout, so that a prefill graph holds only what depends on the token count."""
        cos, sin = self.rope(positions)  # [T, R/2]
        h = scaled(self.embed_tokens(input_ids), self.scale)  # [T, H]
        for layer in self.layers:
            if pause_at_attention:
                core = AttentionCore(layer.layer_idx, *layer.project(h, cos, sin, batch, kv_cache))
                h, boundary = layer.finish(h, (yield core))
            else:
                h, boundary = layer.attend(h, cos, sin, batch, kv_cache)
            if boundary is not None:
                h = h + (yield boundary)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] fp32."""
        return self.lm_head(hidden).float()
