"""Building blocks shared by both sides of the split: RMSNorm, the SwiGLU MLP (dense layers and shared
experts), the MoE gate and rotary embeddings. On CUDA the norm, rope and SwiGLU run afd's Triton kernels
(`afd.kernels`); the eager code here is the CPU path and their tests' oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd import kernels
from afd.model.config import ModelConfig
from afd.model.fp8 import FP8Linear, StackedFP8, linear
from afd.model.moe import select_experts
from afd.routing import Routing


class RMSNorm(nn.Module):
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, normalized in fp32; one Triton kernel on CUDA."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.enabled(x.device):
            from afd.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP: dense layers and shared experts.

    On CUDA (Triton enabled) gate and up run as one GEMM over a `[2I, H]` weight whose two halves *are*
    `gate_proj.weight` and `up_proj.weight` (views, so no second copy of the weights), then one fused
    `silu(g) * u` kernel, then `down_proj`. Parameter names and the state dict stay as checkpoints have them.
    With `fp8_block` the three projections are `FP8Linear` (block-scaled FP8) and gate and up run as one FP8 GEMM
    where they stack (`StackedFP8`: I a multiple of the block's rows).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, fp8_block)
        self.up_proj = linear(hidden_size, intermediate_size, fp8_block)
        self.down_proj = linear(intermediate_size, hidden_size, fp8_block)
        self._gate_up: torch.Tensor | None = None  # [2I, H], built on first CUDA use
        self._can_fuse = True  # False once a CUDA graph captured the unfused weights' addresses
        self._fp8_gate_up = StackedFP8([self.gate_proj, self.up_proj]) if fp8_block else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.enabled(x.device):
            from afd.kernels.swiglu import silu_mul, swiglu

            if self._fp8_gate_up is not None:
                return self.down_proj(silu_mul(*self._fp8_gate_up(x)))
            gate_up = self._gate_up_weight()
            h = swiglu(x, gate_up) if gate_up is not None else silu_mul(self.gate_proj(x), self.up_proj(x))
            return self.down_proj(h)
        gate, up = self._fp8_gate_up(x) if self._fp8_gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)

    def _gate_up_weight(self) -> torch.Tensor | None:
        """The `[2I, H]` gate/up weight, re-pointing both parameters into it on first use (or after a loader
        replaced them). None (two GEMMs) if a CUDA graph is being captured before it exists: a copy recorded
        into a graph does not run at capture, and a graph that recorded the separate weights' addresses would
        read freed memory if they moved later, so this MLP then never fuses. None for FP8 projections."""
        if isinstance(self.gate_proj, FP8Linear):
            return None
        gate, up, fused = self.gate_proj.weight, self.up_proj.weight, self._gate_up
        inter = gate.shape[0]
        if (
            fused is not None
            and gate.data_ptr() == fused.data_ptr()
            and up.data_ptr() == fused[inter:].data_ptr()
            and fused.shape[0] == 2 * inter
            and gate.dtype == up.dtype == fused.dtype
        ):
            return fused
        if not self._can_fuse or gate.device != up.device or gate.dtype != up.dtype:
            return None
        if gate.is_cuda and torch.cuda.is_current_stream_capturing():
            self._can_fuse = False
            return None
        fused = torch.cat([gate.detach(), up.detach()])  # [2I, H]
        if gate.is_cuda:  # the old weights are freed below: no reuse before the copy above has read them
            for old in (gate.data, up.data):
                old.record_stream(torch.cuda.current_stream(gate.device))
        gate.data, up.data = fused[:inter], fused[inter:]
        self._gate_up = fused
        return fused


class Gate(nn.Module):
    """MoE router: fp32 logits, then `select_experts` (shared by both sides)."""

    _fp32: tuple[tuple[int, int], torch.Tensor] | None = None

    def _weight_fp32(self) -> torch.Tensor:
        """The weight in fp32, converted once rather than every step (kept while the weight is unchanged). Never
        cached during CUDA-graph capture, whose kernels do not run until replay."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._fp32 is not None and self._fp32[0] == key:
            return self._fp32[1]
        w32 = w.detach().float()
        if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._fp32 = (key, w32)
        return w32

    def __init__(self, config: ModelConfig, routed_scaling_factor: float) -> None:
        super().__init__()
        self.config = config
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.n_routed_experts)) if config.topk_method == "noaux_tc" else None
        )

    def forward(self, x: torch.Tensor) -> Routing:
        c = self.config
        if kernels.enabled(x.device):  # one launch instead of ~8 (afd.kernels.router)
            from afd.kernels import router

            if router.supports(c) and router.pays(self.weight, x.shape[0]) and x.dtype in router.DTYPES:
                return router.fused_router(x, self.weight, self.e_score_correction_bias, c, self.routed_scaling_factor)
        logits = F.linear(x.float(), self._weight_fp32())  # [T, E]
        return select_experts(
            logits,
            top_k=c.num_experts_per_tok,
            scoring_func=c.scoring_func,
            topk_method=c.topk_method,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            e_score_correction_bias=self.e_score_correction_bias,
        )


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate x [T, ..., R] by cos/sin [T, R/2] (fp32); interleaved pairs (x0, x1) or halves.

    The output is always laid out as [rotated firsts | rotated seconds]; q and k share the layout. `out` (x's shape
    and dtype; may be x itself, e.g. the rope part of q) receives it in place. One Triton kernel on CUDA.
    """
    if kernels.enabled(x.device):
        from afd.kernels.rope import rope

        return rope(x, cos, sin, interleave, out=out)
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else xf.chunk(2, dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotated if out is None else out.copy_(rotated)
