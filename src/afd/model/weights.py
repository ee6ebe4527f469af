"""Role-scoped weight loading: each role reads only the tensors it owns.

A model is a Hugging Face checkpoint directory (`config.json` + `*.safetensors`, tensor names as
`transformers` saves them) or a preset (`tiny`, `deepseek-v2-lite`) whose tensors are drawn from a
generator seeded by (seed, tensor name), so any role can build exactly its own tensors and all roles
agree (on the same device type).

FP8 (`afd.model.fp8`): a checkpoint whose `config.json` has DeepSeek-V3's `quantization_config` ships every
attention/MLP linear as a float8_e4m3fn weight plus its `weight_scale_inv`; both are read as shipped (an FFN rank
reads only its own experts' weights and scales) and stay FP8 in the model. `quantization="fp8"` (`--quantization
fp8`) quantizes a 16/32-bit weight at load with the released recipe instead, from its checkpoint precision (before
any cast to the model dtype), so the two give the same bits. Embeddings, lm_head, norms and the router stay 16/32-bit.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from afd.model.attention_side import AttentionModel, ModelConfig
from afd.model.ffn_side import FFNModel
from afd.model.fp8 import FP8_DTYPE, SCALE_SUFFIX, FP8Linear, quantize, scale_shape
from afd.model.presets import PRESETS, preset_tensor

__all__ = ["PRESETS", "attention_keys", "ffn_keys", "load_attention_model", "load_ffn_model", "load_model_config"]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _is_preset(model: str | Path) -> bool:
    return isinstance(model, str) and model in PRESETS


def load_model_config(model: str | Path, quantization: str | None = None) -> ModelConfig:
    """Config of a preset name or a checkpoint directory, as loaded with `quantization` (None: as it ships; "fp8":
    FP8 linears, `ModelConfig.with_quantization`). ValueError in one sentence for a quantization afd cannot load."""
    if _is_preset(model):
        return ModelConfig.from_hf(PRESETS[str(model)]).with_quantization(quantization)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json"
        )
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text())).with_quantization(quantization)


# --- which tensors each role owns ------------------------------------------------------------------


def _hf_key(name: str) -> str:
    """Our parameter name -> the Hugging Face tensor name (experts are mapped separately)."""
    if name.startswith("lm_head."):
        return name
    name = re.sub(r"^layers\.(\d+)\.gate\.", r"layers.\1.mlp.gate.", name)
    name = re.sub(r"^layers\.(\d+)\.shared_experts\.", r"layers.\1.mlp.shared_experts.", name)
    return "model." + name


def _expert_keys(layer_idx: int, expert: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer_idx}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


_STACKED = (".w13", ".w2", ".w13" + SCALE_SUFFIX, ".w2" + SCALE_SUFFIX)  # the experts' stacked tensors


def _plain_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if not n.endswith(_STACKED))


def attention_keys(config: ModelConfig, *, gate_on_attention: bool = True, shared_experts: bool = False) -> list[str]:
    """Hugging Face tensor names an attention-side load reads."""
    with torch.device("meta"):
        model = AttentionModel(config, gate_on_attention=gate_on_attention, shared_experts=shared_experts)
    keys = [_hf_key(n) for n, _ in model.named_parameters()]
    if config.tie_word_embeddings:
        keys.remove("lm_head.weight")
    return keys


def ffn_keys(
    config: ModelConfig,
    *,
    expert_range: range | tuple[int, int] | None = None,
    gate_on_attention: bool = True,
    shared_experts: bool = True,
) -> list[str]:
    """Hugging Face tensor names an FFN-side load of `expert_range` reads (only those experts)."""
    with torch.device("meta"):
        model = FFNModel(
            config, expert_range=expert_range, gate_on_attention=gate_on_attention, shared_experts=shared_experts
        )
    keys = [_hf_key(n) for n, _ in _plain_params(model)]
    for layer in model.layers:
        if model.layers[layer].experts is not None:
            for e in range(model.expert_start, model.expert_stop):
                keys.extend(_expert_keys(int(layer), e))
                if config.fp8_block is not None:
                    keys.extend(k + SCALE_SUFFIX for k in _expert_keys(int(layer), e))
    return keys


# --- tensor sources --------------------------------------------------------------------------------


class _Checkpoint:
    """Reads named tensors from the safetensors files of a directory, one `get_tensor` per name."""

    def __init__(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"checkpoint directory {str(path)!r} has no *.safetensors files")
        self.where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():
                    self.where[k] = f

    def has(self, key: str) -> bool:
        return key in self.where

    def iter(self, keys: list[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        missing = [k for k in keys if k not in self.where]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors this role needs, e.g. {missing[0]!r}")
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.where[k], []).append(k)
        dev = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt", device=dev) as handle:
                for k in names:
                    yield k, handle.get_tensor(k)


def _is_gate_key(key: str) -> bool:
    return re.search(r"\.gate\.(weight|e_score_correction_bias)$", key) is not None


def _gate_dtype(key: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The router's tensors are read in fp32 (its logits are fp32), but its weight is kept in a 16-bit model's
    dtype wherever that holds its values exactly: the released checkpoints ship it in bf16, and a 16-bit weight
    takes the router kernel's tensor-core path, whose products of 16-bit rows and weights are exact in fp32 anyway
    (one H200: DeepSeek-V3's router 24 against 71 us a layer at 8 tokens; V2-Lite's 6 against 11). Anything
    else (an fp32 weight with more bits, the correction bias) stays fp32."""
    if key.endswith(".gate.weight") and dtype.itemsize == 2 and t.is_floating_point():
        narrow = t.to(dtype)
        if torch.equal(narrow.to(t.dtype), t):
            return dtype
    return torch.float32


def _read(
    model_ref: str | Path,
    config: ModelConfig,
    keys: list[str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    model: nn.Module,
) -> dict[str, torch.Tensor]:
    """The tensors `keys`, on `device`. An FP8 linear's weight (one whose `<weight>_scale_inv` is in `keys`) comes
    as float8_e4m3fn with its fp32 scale: as shipped, or quantized here from a 16/32-bit weight. The gate's tensors
    are cast to float32 unless `dtype` holds the weight exactly (`_gate_dtype`), everything else to `dtype`, one
    tensor at a time."""
    scale_keys = {k for k in keys if k.endswith(SCALE_SUFFIX)}
    plain = [k for k in keys if k not in scale_keys]
    if _is_preset(model_ref):
        shapes = {_hf_key(n): tuple(p.shape) for n, p in _plain_params(model)}
        H, inter = config.hidden_size, config.moe_intermediate_size
        for k in plain:
            if ".mlp.experts." in k:
                shapes[k] = (H, inter) if k.endswith("down_proj.weight") else (inter, H)
        shipped: set[str] = set()
        release = PRESETS[str(model_ref)].get("torch_dtype")
        raw: Iterator[tuple[str, torch.Tensor]] = (
            (k, preset_tensor(seed, k, shapes[k], device, release)) for k in plain
        )
    else:
        checkpoint = _Checkpoint(Path(model_ref))
        shipped = {k for k in scale_keys if checkpoint.has(k)}
        raw = checkpoint.iter(plain + sorted(shipped), device)
    out: dict[str, torch.Tensor] = {}
    waiting: dict[str, torch.Tensor] = {}  # an FP8 weight or a scale whose partner has not been read yet
    for k, t in raw:
        if k in scale_keys or k + SCALE_SUFFIX in scale_keys:
            weight_key = k.removesuffix(SCALE_SUFFIX)
            if k == weight_key and (t.dtype != FP8_DTYPE or weight_key + SCALE_SUFFIX not in shipped):
                out[k], out[k + SCALE_SUFFIX] = _quantized(k, t, config, shipped)
            elif (partner := waiting.pop(k + SCALE_SUFFIX if k == weight_key else weight_key, None)) is not None:
                w, scale = (t, partner) if k == weight_key else (partner, t)
                out[weight_key], out[weight_key + SCALE_SUFFIX] = _fp8_pair(weight_key, w, scale, config, device)
            else:
                waiting[k] = t
        else:
            if t.element_size() == 1 and t.is_floating_point():
                raise ValueError(
                    f"the checkpoint ships {k!r} in {str(t.dtype).removeprefix('torch.')}; afd reads float8 only for "
                    "the attention/MLP linears of a config.json whose quantization_config is fp8"
                )
            out[k] = t.to(device=device, dtype=_gate_dtype(k, t, dtype) if _is_gate_key(k) else dtype)
    return out


def _quantized(key: str, w: torch.Tensor, config: ModelConfig, shipped: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16/32-bit linear weight `[out, in]` of an FP8 model, quantized with the released recipe."""
    if w.dtype == FP8_DTYPE:
        raise ValueError(f"the checkpoint ships {key!r} in float8_e4m3fn without its {key + SCALE_SUFFIX!r}")
    if key + SCALE_SUFFIX in shipped:
        raise ValueError(f"the checkpoint ships {key + SCALE_SUFFIX!r} but {key!r} in {w.dtype}, not float8_e4m3fn")
    if w.is_floating_point() and w.element_size() == 1:
        raise ValueError(f"the checkpoint ships {key!r} in {w.dtype}; afd loads float8 weights only as e4m3fn")
    return quantize(w, config.fp8_block)


def _fp8_pair(
    key: str, w: torch.Tensor, scale: torch.Tensor, config: ModelConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shipped FP8 weight `[out, in] float8_e4m3fn` and its scales, checked against the block size."""
    want = scale_shape(tuple(w.shape), config.fp8_block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{key + SCALE_SUFFIX!r} has shape {tuple(scale.shape)}, but a {tuple(w.shape)} weight in blocks of "
            f"{config.fp8_block} needs {want}"
        )
    return w.to(device), scale.to(device=device, dtype=torch.float32)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    old = module._parameters[attr]
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor for {name!r} has shape {tuple(tensor.shape)}, expected {tuple(old.shape)}")
    module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put loaded tensors into a meta-built model (experts are stacked separately)."""
    for n, _ in list(_plain_params(model)):
        _assign(model, n, tensors[_hf_key(n)])


def preset_checkpoint(name: str, *, dtype: str | torch.dtype = "float32", seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of preset `name` under its Hugging Face name (both roles, every expert), on the CPU, as a
    checkpoint directory holds them: the tensors `load_*_model(name, seed=seed)` build (`afd export`)."""
    config, dtype, device = load_model_config(name), resolve_dtype(dtype), torch.device("cpu")
    with torch.device("meta"):
        attention = AttentionModel(config, dtype=dtype)
        ffn = FFNModel(config)
    out = _read(name, config, attention_keys(config), dtype=dtype, device=device, seed=seed, model=attention)
    out.update(_read(name, config, ffn_keys(config), dtype=dtype, device=device, seed=seed, model=ffn))
    return out


def load_attention_model(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gate_on_attention: bool = True,
    seed: int = 0,
    shared_experts: bool = False,
    quantization: str | None = None,
) -> AttentionModel:
    """Attention side: embedding, attention, norms, gate / dense MLPs (gate on attention), lm_head (and the shared
    experts with `shared_experts`). `quantization`: None loads the checkpoint's format, "fp8" FP8 linears."""
    config = load_model_config(model, quantization)
    dtype, device = resolve_dtype(dtype), torch.device(device)
    with torch.device("meta"):
        out = AttentionModel(config, gate_on_attention=gate_on_attention, dtype=dtype, shared_experts=shared_experts)
    keys = attention_keys(config, gate_on_attention=gate_on_attention, shared_experts=shared_experts)
    tensors = _read(model, config, keys, dtype=dtype, device=device, seed=seed, model=out)
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    _fill(out, tensors)
    for layer in out.layers:  # the absorbed decode reads kv_b_proj whole every step
        if isinstance(layer.self_attn.kv_b_proj, FP8Linear):
            layer.self_attn.kv_b_proj.keep_dense(dtype)
    logger.info("attention model loaded: %d tensors, %s on %s", len(keys), dtype, device)
    return out.eval()


def load_ffn_model(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    expert_range: range | tuple[int, int] | None = None,
    gate_on_attention: bool = True,
    seed: int = 0,
    shared_experts: bool = True,
    quantization: str | None = None,
) -> FFNModel:
    """FFN side: routed experts of `expert_range` (default all), shared experts (unless `shared_experts=False`),
    gate/dense MLPs (gate on FFN). `quantization`: None loads the checkpoint's format, "fp8" FP8 linears."""
    config = load_model_config(model, quantization)
    dtype, device = resolve_dtype(dtype), torch.device(device)
    with torch.device("meta"):
        out = FFNModel(
            config,
            expert_range=expert_range,
            gate_on_attention=gate_on_attention,
            dtype=dtype,
            shared_experts=shared_experts,
        )
    keys = ffn_keys(
        config, expert_range=expert_range, gate_on_attention=gate_on_attention, shared_experts=shared_experts
    )
    tensors = _read(model, config, keys, dtype=dtype, device=device, seed=seed, model=out)
    _fill(out, tensors)
    for layer_name, layer in out.layers.items():
        if layer.experts is None:
            continue
        keys = [_expert_keys(int(layer_name), e) for e in range(out.expert_start, out.expert_stop)]
        H, inter = config.hidden_size, config.moe_intermediate_size
        weight_dtype = dtype if config.fp8_block is None else FP8_DTYPE
        _stack_experts(out, layer_name, "", tensors, keys, ((inter, H), (H, inter)), weight_dtype, device)
        if config.fp8_block is not None:
            block = config.fp8_block
            scales = (scale_shape((inter, H), block), scale_shape((H, inter), block))
            scale_keys = [tuple(k + SCALE_SUFFIX for k in ks) for ks in keys]
            _stack_experts(out, layer_name, SCALE_SUFFIX, tensors, scale_keys, scales, torch.float32, device)
    logger.info("FFN model loaded: experts [%d, %d), %s on %s", out.expert_start, out.expert_stop, dtype, device)
    return out.eval()


def _stack_experts(
    out: FFNModel,
    layer_name: str,
    suffix: str,
    tensors: dict[str, torch.Tensor],
    keys: list[tuple[str, str, str]],
    shapes: tuple[tuple[int, int], tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Stack one layer's (gate, up, down) tensors of every local expert into `experts.w13{suffix}` ([E, 2 * I, H]:
    gate rows, then up rows) and `experts.w2{suffix}` ([E, H, I]); with suffix `_scale_inv`, their FP8 scales.
    `shapes`: one expert's gate and down tensor shapes. Each tensor leaves `tensors` as it is stacked."""
    w13, w2 = [], []
    for gate_key, up_key, down_key in keys:
        w13.append(torch.cat([tensors.pop(gate_key), tensors.pop(up_key)], dim=0))
        w2.append(tensors.pop(down_key))
    (rows, cols), down = shapes
    _assign(out, f"layers.{layer_name}.experts.w13{suffix}", _stack(w13, (0, 2 * rows, cols), dtype, device))
    _assign(out, f"layers.{layer_name}.experts.w2{suffix}", _stack(w2, (0, *down), dtype, device))


def _stack(
    ts: list[torch.Tensor], empty_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if not ts:
        return torch.empty(empty_shape, dtype=dtype, device=device)
    return torch.stack([t.to(device=device, dtype=dtype) for t in ts])
