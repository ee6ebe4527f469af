"""Block-scaled FP8 weights in DeepSeek-V3's released format.

Every attention and MLP linear (`q_a_proj`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`,
`gate_proj`, `up_proj`, `down_proj`, routed and shared experts) is stored as `W_fp8: [out, in] float8_e4m3fn`
plus `weight_scale_inv: [ceil(out/b0), ceil(in/b1)] float32`, and means
`W[i, j] = W_fp8[i, j] * weight_scale_inv[i // b0, j // b1]`, `(b0, b1)` from `config.json`'s
`quantization_config.weight_block_size` (128 x 128 in the release; the last block of a dimension may be ragged).
`--quantization fp8` makes the same pair from a 16/32-bit weight: per block, `scale = amax / 448` and
`W_fp8 = round_to_nearest_e4m3(W / scale)`, so a model quantized at load equals the same weights shipped in FP8.

Where dequantization happens: the weights stay FP8 in the model (`FP8Linear`, and the experts' stacked `w13`/`w2`
with their scales in `afd.model.ffn_side.Experts`, handed to the MoE as `FP8Experts`). On CUDA (sm89+, Triton) the
linears run `afd.kernels.fp8_linear` on the FP8 bytes and the routed experts afd's MoE kernels at decode sizes
(`afd.model.moe.fp8_routed_experts`, rows quantized to fp8 too), scales applied in the kernels; past those sizes
(prefill, compute bound) the weight is dequantized in one Triton pass and the 16-bit GEMM runs (`dequantized`), as
everything else does, which on CPU is the eager `dequantize`. Why not dequantize once at load: the
memory a rank holds is then the FP8 bytes (what lets DeepSeek-V3 fit one node, and what `afd.runtime.resources` and
`afd bench step`'s floor count), and the tensors a block-scaled FP8 kernel reads (weight, scale, block size) are
already where the matmul is. The eager dequantization is the CPU path and the kernels' test oracle; it is correct,
not fast (it expands the scales to every element).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from afd import kernels

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's release, and `--quantization fp8`
SCALE_SUFFIX = "_scale_inv"  # `<weight>_scale_inv`, e.g. `o_proj.weight_scale_inv`
QUANTIZATIONS = ("fp8",)  # what `--quantization` accepts
_QUANT_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}


def parse_quantization_config(qc: Any) -> tuple[int, int] | None:
    """The FP8 block size `(b0, b1)` of a `config.json`'s `quantization_config` (None when there is none).

    Only DeepSeek-V3's format is supported: quant_method fp8, fmt e4m3, dynamic activations, a two-int block size.
    Anything else raises ValueError in one sentence: a quantization afd would ignore must not run as if absent."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported; afd loads only fp8")
    unknown = sorted(set(qc) - _QUANT_KEYS)
    if unknown:
        raise ValueError(f"quantization_config key {unknown[0]!r} is not supported by afd's fp8 loader")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config fmt {qc['fmt']!r} is not supported; afd loads only e4m3")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config activation_scheme {qc['activation_scheme']!r} is not supported; only dynamic is"
        )
    if qc.get("modules_to_not_convert"):
        raise ValueError("quantization_config modules_to_not_convert is not supported; every linear must be fp8")
    block = qc.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantization_config weight_block_size {block!r} is not supported; afd needs two positive ints"
        )
    return int(block[0]), int(block[1])


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scales of a weight `[..., out, in]`: `[..., ceil(out/b0), ceil(in/b1)]`."""
    *lead, out, inp = shape
    return (*lead, -(-out // block[0]), -(-inp // block[1]))


def _expand(scale: torch.Tensor, block: tuple[int, int], out: int, inp: int) -> torch.Tensor:
    """Scales `[..., ceil(out/b0), ceil(in/b1)]` -> one per element `[..., out, in]` (ragged edges cut)."""
    rows = scale.repeat_interleave(block[0], dim=-2)[..., :out, :]
    return rows.repeat_interleave(block[1], dim=-1)[..., :inp]


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w: [..., out, in]` (any float dtype) -> `(w_fp8 [..., out, in] float8_e4m3fn, scale_inv [..., ceil(out/b0),
    ceil(in/b1)] float32)` with the released recipe: per block `scale = amax / 448`, `w_fp8 = round(w / scale)`
    (nearest, ties to even). An all-zero block gets scale 1 (its values are zero either way)."""
    *lead, out, inp = w.shape
    b0, b1 = block
    n0, n1 = -(-out // b0), -(-inp // b1)
    wf = w.float()
    padded = F.pad(wf, (0, n1 * b1 - inp, 0, n0 * b0 - out))  # [..., n0*b0, n1*b1]; zeros do not change amax
    blocks = padded.reshape(*lead, n0, b0, n1, b1)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., n0, n1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / _expand(scale, block, out, inp)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`w: [..., out, in] float8_e4m3fn`, `scale_inv: [..., ceil(out/b0), ceil(in/b1)] float32` -> `[..., out, in]
    dtype`: `w[i, j] * scale_inv[i // b0, j // b1]`, the product in fp32, then one rounding to `dtype`."""
    out, inp = w.shape[-2:]
    return (w.float() * _expand(scale_inv.float(), block, out, inp)).to(dtype)


@cache
def _fp8_convert_capable(device_index: int) -> bool:
    """Triton converts float8_e4m3fn in registers on sm89 and later only."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _fp8_linear_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether rows of `dtype` on `device` take the FP8 linear kernel: `afd.kernels.enabled` (CUDA, Triton, not
    inside `eager_ops`), a 16/32-bit float dtype, and a GPU with fp8 tensor cores (sm89+)."""
    return (
        dtype in (torch.bfloat16, torch.float16, torch.float32)
        and kernels.enabled(device)
        and _fp8_convert_capable(device.index if device.index is not None else torch.cuda.current_device())
    )


def block_in_kernels(block: tuple[int, int]) -> bool:
    """Whether the kernels take scale blocks of this size (b1 a multiple of 32: they quantize the rows in b1-wide
    groups for fp8 x fp8 MMAs; import only once enabled)."""
    from afd.kernels.moe_tiles import FP8_MIN_BLOCK_K, fp8_block_supported

    return fp8_block_supported(block, FP8_MIN_BLOCK_K)


def dequantized(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """`dequantize`, the same bits, in one Triton launch where the FP8 kernels run: the path
    prefill-sized calls take every step, where the PyTorch ops' per-element scale tensor costs milliseconds."""
    if not _fp8_linear_enabled(w.device, dtype):
        return dequantize(w, scale_inv, block, dtype)
    from afd.kernels.fp8_linear import dequantize_weight

    return dequantize_weight(w, scale_inv, block, dtype)


class FP8Linear(nn.Module):
    """A linear layer whose weight stays block-scaled FP8: `weight: [out, in] float8_e4m3fn`,
    `weight_scale_inv: [ceil(out/b0), ceil(in/b1)] float32`, optional `bias: [out]` in the model dtype.
    `forward(x: [..., in]) -> [..., out]` in x's dtype: on CUDA the block-scaled FP8 GEMM
    (`afd.kernels.fp8_linear`, only fp8 bytes read) where it takes the block size, else through the dequantized
    weight (the CPU path and the oracle)."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        shape = scale_shape((out_features, in_features), block)
        self.weight_scale_inv = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.dense: torch.Tensor | None = None  # the weight also kept dequantized (`keep_dense`)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight `[out, in]` in `dtype`."""
        return dequantized(self.weight, self.weight_scale_inv, self.block, dtype)

    def keep_dense(self, dtype: torch.dtype) -> None:
        """Keep the weight dequantized in `dtype` beside its FP8 bytes, for a projection also used whole
        (`linear_weight`: MLA's absorbed decode reads kv_b_proj's every step), which would otherwise be expanded at
        every call. Done at load, so the memory it takes is counted before the KV cache is sized. `forward` then
        multiplies by it too: the rows are not quantized, so a sequence's keys and values are the same whichever
        form of attention its step takes (expanded for prompts, absorbed for single-token sequences); with the
        rows quantized in the expansion only, a one-token prompt's output moved by their fp8 rounding (~3%)
        between a step that attended it as a prompt and one that attended it as a decode."""
        self.dense = self.dequantized(dtype)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` runs the FP8 kernel rather than the dequantized weight."""
        return _fp8_linear_enabled(x.device, x.dtype) and block_in_kernels(self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and self.dense.dtype == x.dtype:  # one function for both uses of the weight
            return F.linear(x, self.dense, self.bias)
        if self.uses_kernel(x):
            from afd.kernels.fp8_linear import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


class StackedFP8:
    """FP8Linears that read one input (gate and up; q or q_a and kv_a), run as one: their weights and scales stacked
    along the outputs into one FP8Linear, so the rows are quantized once and one GEMM launches instead of one per
    part (V2-Lite's small linears are bound by launches, not bytes). Each part's parameters become views of the
    stack (no second copy; state dict unchanged). `get()` builds it on first use and again if a loader replaced a
    part's weight, never while a CUDA graph is being captured (a graph that recorded the parts' own addresses would
    read freed memory once they moved; such parts then stay apart). None where the parts cannot stack: a bias,
    different blocks, inputs or devices, or a part other than the last ending inside a scale block (the stacked
    scale rows would then straddle two parts)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        self.sizes = [getattr(p, "out_features", 0) for p in parts]
        self._stack: FP8Linear | None = None
        self._stacked_at: list[int] = []  # `_addresses()` when the stack was built
        self._can_build = (
            all(isinstance(p, FP8Linear) and p.bias is None for p in parts)
            and len({(p.block, p.in_features) for p in parts}) == 1
            and all(p.out_features % p.block[0] == 0 for p in parts[:-1])
        )

    def get(self) -> FP8Linear | None:
        stack = self._stack
        if stack is not None and self._addresses() == self._stacked_at:
            return stack
        weights = [p.weight for p in self.parts]
        if not self._can_build or len({w.device for w in weights}) > 1:
            return None
        if weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
            self._can_build = False
            return None
        first = self.parts[0]
        with torch.device("meta"):
            stack = FP8Linear(first.in_features, sum(self.sizes), first.block)
        stack.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
        scales = [p.weight_scale_inv.detach() for p in self.parts]
        stack.weight_scale_inv = nn.Parameter(torch.cat(scales), requires_grad=False)
        if weights[0].is_cuda:  # the parts' own tensors are freed below: no reuse before the copies have read them
            for old in (*weights, *scales):
                old.record_stream(torch.cuda.current_stream(weights[0].device))
        rows = scale_rows = 0
        for part, size in zip(self.parts, self.sizes, strict=True):
            part_scale_rows = part.weight_scale_inv.shape[0]
            part.weight.data = stack.weight[rows : rows + size]
            part.weight_scale_inv.data = stack.weight_scale_inv[scale_rows : scale_rows + part_scale_rows]
            rows, scale_rows = rows + size, scale_rows + part_scale_rows
        self._stack, self._stacked_at = stack, self._addresses()
        return stack

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's output of rows `x`: through the stack where the kernel runs and the parts stack, else part by
        part (the CPU path: the dequantized weights' GEMMs gain nothing from one launch)."""
        stack = self.get() if self.parts[0].uses_kernel(x) else None
        if stack is None:
            return [p(x) for p in self.parts]
        return list(stack(x).split(self.sizes, dim=-1))

    def _addresses(self) -> list[int]:
        """Where each part's weight and scales live: the stack's rows once built, until a loader replaces either."""
        return [t.data_ptr() for p in self.parts for t in (p.weight, p.weight_scale_inv)]


def warm_up_fp8_linears(model: nn.Module, dtype: torch.dtype, max_rows: int) -> int:
    """Compile the FP8 linear kernel for every distinct `FP8Linear` shape of `model` that takes it, at every tile
    bucket up to `max_rows` rows of `dtype` (`afd.kernels.fp8_linear.warm_up`), the `StackedFP8` stacks built and
    warmed too; returns how many shapes. Nothing where the kernel does not run (CPU, a 16-bit model)."""
    seen: set[tuple] = set()
    stacks = [s for m in model.modules() for s in vars(m).values() if isinstance(s, StackedFP8)]
    built = [s.get() for s in stacks if _fp8_linear_enabled(s.parts[0].weight.device, dtype)]
    for module in [*model.modules(), *(s for s in built if s is not None)]:
        if not isinstance(module, FP8Linear) or not _fp8_linear_enabled(module.weight.device, dtype):
            continue
        key = (module.out_features, module.in_features, module.block, module.bias is None, module.weight.device)
        if key in seen or not block_in_kernels(module.block):
            continue
        seen.add(key)
        from afd.kernels.fp8_linear import warm_up

        warm_up(module.weight, module.weight_scale_inv, module.block, dtype, max_rows, module.bias)
    return len(seen)


@dataclass(frozen=True)
class FP8Experts:
    """A layer's stacked routed experts in FP8: `w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`
    float8_e4m3fn, `w13_scale_inv [E, 2 * ceil(I/b0), ceil(H/b1)]` (gate's scale rows, then up's: each half keeps
    its own ragged edge) and `w2_scale_inv [E, ceil(H/b0), ceil(I/b1)]` float32, in blocks of `block = (b0, b1)`."""

    w13: torch.Tensor
    w13_scale_inv: torch.Tensor
    w2: torch.Tensor
    w2_scale_inv: torch.Tensor
    block: tuple[int, int]

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w13 [E, 2I, H], w2 [E, H, I])` in `dtype`, expanded at every call (the CPU path, the oracle, and
        prefill-sized batches on the GPU, where the 16-bit grouped GEMM outruns the fused FP8 kernels)."""
        inter, half = self.w13.shape[1] // 2, self.w13_scale_inv.shape[1] // 2
        gate = dequantized(self.w13[:, :inter], self.w13_scale_inv[:, :half], self.block, dtype)  # [E, I, H]
        up = dequantized(self.w13[:, inter:], self.w13_scale_inv[:, half:], self.block, dtype)  # [E, I, H]
        return torch.cat([gate, up], dim=1), dequantized(self.w2, self.w2_scale_inv, self.block, dtype)

    def shard(self, start: int, stop: int) -> FP8Experts:
        """Experts `[start, stop)` of the stack (views, no copy)."""
        return FP8Experts(
            self.w13[start:stop],
            self.w13_scale_inv[start:stop],
            self.w2[start:stop],
            self.w2_scale_inv[start:stop],
            self.block,
        )


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int]) -> FP8Experts:
    """Stacked 16/32-bit experts `w13 [E, 2I, H]`, `w2 [E, H, I]` -> `FP8Experts`, gate and up quantized apart (as
    the checkpoint stores `gate_proj` and `up_proj`)."""
    inter = w13.shape[1] // 2
    (gate, s_gate), (up, s_up) = quantize(w13[:, :inter], block), quantize(w13[:, inter:], block)
    q2, s2 = quantize(w2, block)
    return FP8Experts(torch.cat([gate, up], 1), torch.cat([s_gate, s_up], 1), q2, s2, block)


def linear(in_features: int, out_features: int, block: tuple[int, int] | None, bias: bool = False) -> nn.Module:
    """`nn.Linear` for 16/32-bit weights, `FP8Linear` when the model's linears are FP8 in blocks of `block`."""
    if block is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return FP8Linear(in_features, out_features, block, bias=bias)


def linear_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[out, in]` of an `nn.Linear` or `FP8Linear`, in `dtype` (an nn.Linear's own tensor as it is)."""
    if isinstance(module, FP8Linear):
        dense = module.dense
        return dense if dense is not None and dense.dtype == dtype else module.dequantized(dtype)
    return module.weight
