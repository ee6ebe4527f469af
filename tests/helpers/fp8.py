"""Tiny DeepSeek-V3 checkpoints in the released FP8 format, written from the format's definition (block loops here,
independent of `afd.model.fp8`): every attention/MLP linear as float8_e4m3fn plus `weight_scale_inv`
`[ceil(out/b0), ceil(in/b1)]` fp32 with `W[i, j] = W_fp8[i, j] * weight_scale_inv[i // b0, j // b1]`, the rest in
16/32 bits, and `quantization_config` in config.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers.hf import spread_weights

FP8_LINEAR = re.compile(r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)")
# V3 shapes with dimensions above 128 and ragged against both 16 and 128 (hidden 144, q_lora 136, intermediate 200,
# kv_b 160 rows, experts 40 wide), so 16 x 16 and 128 x 128 blocks both have full and partial blocks.
V3_FP8 = dict(
    vocab_size=101,
    hidden_size=144,
    intermediate_size=200,
    moe_intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=136,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=64,
)


def quantization_config(block: tuple[int, int]) -> dict:
    """DeepSeek-V3's `quantization_config` with `weight_block_size` = block."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], fp32 scale_inv [ceil(out/b0), ceil(in/b1)]), block by block:
    scale = amax / 448, values rounded to nearest e4m3."""
    w = w.float()
    out, inp = w.shape
    b0, b1 = block
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-out // b0), -(-inp // b1))
    for bi, i in enumerate(range(0, out, b0)):
        for bj, j in enumerate(range(0, inp, b1)):
            tile = w[i : i + b0, j : j + b1]
            s = tile.abs().max() / 448.0
            s = s if s > 0 else torch.tensor(1.0)
            scale[bi, bj] = s
            q[i : i + b0, j : j + b1] = (tile / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 weight an FP8 pair means: element (i, j) times scale[i // b0, j // b1]."""
    w = q.float()
    b0, b1 = block
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            w[bi * b0 : (bi + 1) * b0, bj * b1 : (bj + 1) * b1] *= scale[bi, bj]
    return w


def read_all(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
    return tensors


def save_shards(tensors: dict[str, torch.Tensor], path: Path, config: dict) -> None:
    """Two safetensors shards (keys split in half), their index and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(path / name))
        weight_map |= dict.fromkeys(part, name)
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config, indent=2))


def save_fp32_model(path: Path, seed: int = 0, **overrides) -> Path:
    """A random transformers DeepseekV3 model of `V3_FP8` shapes (+ overrides), saved in fp32 to `path`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**V3_FP8, **overrides})).eval()
    spread_weights(model)
    model.save_pretrained(path)
    return path


def write_fp8(src: Path, dst: Path, block: tuple[int, int], others: torch.dtype | None = torch.bfloat16) -> Path:
    """The fp32 checkpoint `src` shipped as DeepSeek-V3 does: linears FP8 in `block` blocks, the correction bias
    fp32, everything else in `others` (None: as in `src`)."""
    out = {}
    for k, t in read_all(src).items():
        if FP8_LINEAR.search(k) and k.endswith(".weight"):
            out[k], out[k + "_scale_inv"] = block_quantize(t, block)
        elif k.endswith("e_score_correction_bias") or others is None:
            out[k] = t
        else:
            out[k] = t.to(others)
    config = json.loads((src / "config.json").read_text())
    save_shards(out, dst, {**config, "quantization_config": quantization_config(block)})
    return dst


def write_dequantized(fp8: Path, dst: Path) -> Path:
    """What the FP8 checkpoint `fp8` means, as a plain fp32 checkpoint (no quantization_config)."""
    config = json.loads((fp8 / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = read_all(fp8)
    out = {}
    for k, t in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        scale = tensors.get(k + "_scale_inv")
        out[k] = block_dequantize(t, scale, block) if scale is not None else t.float()
    save_shards(out, dst, config)
    return dst
