"""The FFN side of the split: routed experts of one expert range, shared experts, and (gate on FFN)
the gate and dense MLPs. Every method is a function of (layer, rows, routing) a connector can call."""

from __future__ import annotations

import torch
from torch import nn

from afd.model.config import ModelConfig, scaled
from afd.model.fp8 import FP8_DTYPE, FP8Experts, scale_shape
from afd.model.layers import MLP, Gate
from afd.model.moe import (
    fp8_grouped_expert_mlp,
    fp8_grouped_expert_mlp_offsets,
    fp8_routed_experts,
    grouped_expert_mlp,
    grouped_expert_mlp_offsets,
    routed_experts,
)
from afd.routing import Routing


class Experts(nn.Module):
    """Routed experts `[expert_start, expert_start + num_local_experts)` of one layer, stacked:
    `w13: [E, 2I, H]` (gate rows, then up rows) and `w2: [E, H, I]` in the model dtype, or, when the model's
    linears are FP8 (`config.fp8_block`), in float8_e4m3fn with `w13_scale_inv: [E, 2 * ceil(I/b0), ceil(H/b1)]`
    (gate's scale rows, then up's: each half keeps its own ragged edge) and `w2_scale_inv: [E, ceil(H/b0),
    ceil(I/b1)]` float32 (`fp8()` hands them to the MoE, which runs them in FP8 kernels on CUDA or dequantizes)."""

    def __init__(self, config: ModelConfig, num_local_experts: int) -> None:
        super().__init__()
        H, inter, block = config.hidden_size, config.moe_intermediate_size, config.fp8_block
        self.block, self.intermediate_size = block, inter
        dtype = FP8_DTYPE if block is not None else None
        self.w13 = nn.Parameter(torch.empty(num_local_experts, 2 * inter, H, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local_experts, H, inter, dtype=dtype), requires_grad=False)
        self.w13_scale_inv: nn.Parameter | None = None
        self.w2_scale_inv: nn.Parameter | None = None
        if block is not None:
            gate_scales = scale_shape((num_local_experts, inter, H), block)
            shape13 = (num_local_experts, 2 * gate_scales[1], gate_scales[2])
            self.w13_scale_inv = nn.Parameter(torch.empty(shape13), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(scale_shape(tuple(self.w2.shape), block)), requires_grad=False)

    def fp8(self) -> FP8Experts | None:
        """The stacked FP8 weights and their scales (None for 16/32-bit experts)."""
        if self.block is None:
            return None
        return FP8Experts(self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, self.block)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w13 [E, 2I, H], w2 [E, H, I])` in `dtype`: the stacked tensors themselves, or their dequantized copies
        (FP8: every call expands them; the CPU path and the kernels' oracle, correct rather than fast)."""
        fp8 = self.fp8()
        return (self.w13, self.w2) if fp8 is None else fp8.dequantized(dtype)


class FFNLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        num_local_experts: int,
        gate_on_attention: bool,
        dtype: torch.dtype,
        shared_experts: bool = True,
    ) -> None:
        super().__init__()
        is_moe = config.is_moe_layer(layer_idx)
        block = config.fp8_block
        self.mlp = MLP(config.hidden_size, config.intermediate_size, block) if not is_moe else None
        rsf = 1.0 if dtype == torch.float16 else config.routed_scaling_factor
        self.gate = Gate(config, rsf) if is_moe and not gate_on_attention else None
        self.experts = Experts(config, num_local_experts) if is_moe else None
        shared_size = config.moe_intermediate_size * config.n_shared_experts
        has_shared = shared_experts and is_moe and shared_size > 0
        self.shared_experts = MLP(config.hidden_size, shared_size, block) if has_shared else None


class FFNModel(nn.Module):
    """Routed experts `[expert_start, expert_stop)`, shared experts, and gate/dense MLPs when the gate is on FFN."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        expert_range: range | tuple[int, int] | None = None,
        gate_on_attention: bool = True,
        dtype: torch.dtype = torch.float32,
        shared_experts: bool = True,
    ) -> None:
        """shared_experts=False: the attention side runs them (the async connector's `shared_experts_on_attention`);
        `shared` then answers zeros."""
        super().__init__()
        if expert_range is None:
            expert_range = range(config.n_routed_experts)
        start, stop = (expert_range.start, expert_range.stop) if isinstance(expert_range, range) else expert_range
        if not 0 <= start <= stop <= config.n_routed_experts:
            raise ValueError(f"expert range [{start}, {stop}) is outside [0, {config.n_routed_experts})")
        self.config, self.gate_on_attention, self.dtype = config, gate_on_attention, dtype
        self.expert_start, self.expert_stop = start, stop
        self.num_local_experts = stop - start
        self.has_shared_experts = shared_experts and config.n_shared_experts > 0
        self.scale = config.residual_scale(dtype)
        # Routed-expert path of `experts_topk`: None picks the fixed-shape, host-sync-free one where
        # `torch._grouped_mm` runs natively (CUDA sm90+, bf16) and the exact loop elsewhere (afd.model.moe).
        self.fixed_shape_moe: bool | None = None
        layer_ids = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i) or not gate_on_attention]
        self.layers = nn.ModuleDict(
            {
                str(i): FFNLayer(config, i, self.num_local_experts, gate_on_attention, dtype, shared_experts)
                for i in layer_ids
            }
        )

    def _layer(self, layer_idx: int) -> FFNLayer:
        return self.layers[str(layer_idx)]  # type: ignore[return-value]

    def route(self, layer_idx: int, x: torch.Tensor) -> Routing:
        """x [T, H] -> Routing (gate on FFN only)."""
        gate = self._layer(layer_idx).gate
        if gate is None:
            raise ValueError(f"layer {layer_idx} has no gate on the FFN side")
        return gate(x)

    def dense(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """Dense MLP of a non-MoE layer (gate on FFN only): [T, H] -> [T, H]."""
        return scaled(self._layer(layer_idx).mlp(x), self.scale)

    def experts(self, layer_idx: int, x_grouped: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        """Rows grouped by local expert [N, H] -> unweighted expert outputs [N, H] (the async form)."""
        experts = self._layer(layer_idx).experts
        if (fp8 := experts.fp8()) is not None:
            return fp8_grouped_expert_mlp(x_grouped, group_sizes, fp8)
        return grouped_expert_mlp(x_grouped, group_sizes, *experts.weights(x_grouped.dtype))

    def experts_offsets(self, layer_idx: int, x_grouped: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Like `experts` with the groups given as cumulative ends `offs [E_local] int32` on x's device, so
        the sizes never go through the host; rows at and past `offs[-1]` come back undefined.
        Needs `torch._grouped_mm` (native on CUDA sm90+ in bf16)."""
        experts = self._layer(layer_idx).experts
        if (fp8 := experts.fp8()) is not None:
            return fp8_grouped_expert_mlp_offsets(x_grouped, offs, fp8)
        return grouped_expert_mlp_offsets(x_grouped, offs, *experts.weights(x_grouped.dtype))

    def experts_topk(self, layer_idx: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> fp32 [T, H]: weighted sum over the (t, k) pairs whose expert is local (the p2p form)."""
        experts, ids, weights = self._layer(layer_idx).experts, routing.topk_ids, routing.topk_weights
        if (fp8 := experts.fp8()) is not None:
            return fp8_routed_experts(x, ids, weights, fp8, self.expert_start, fixed_shape=self.fixed_shape_moe)
        w13, w2 = experts.weights(x.dtype)
        return routed_experts(x, ids, weights, w13, w2, self.expert_start, fixed_shape=self.fixed_shape_moe)

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """Shared experts: [T, H] -> [T, H] (zeros when the model has none)."""
        mlp = self._layer(layer_idx).shared_experts
        return scaled(mlp(x), self.scale) if mlp is not None else torch.zeros_like(x)

    def forward(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        """The whole MLP of one layer with the local experts: [T, H] -> [T, H] model dtype."""
        if not self.config.is_moe_layer(layer_idx):
            return self.dense(layer_idx, x)
        if routing is None:
            routing = self.route(layer_idx, x)
        out = self.experts_topk(layer_idx, x, routing)  # [T, H] fp32
        return (out + self.shared(layer_idx, x).float()).to(x.dtype)
