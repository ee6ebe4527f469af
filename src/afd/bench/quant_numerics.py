"""How far a quantized model's next-token distributions lie from the same model unquantized: the numerics target of
FP8 (`--quantization fp8` against the 16-bit weights it was made from).

Three runs over the same random prompts, each one forward without a cache (the oracle's way of scoring every
position): the 16-bit reference, the quantized model on its kernels, and the same quantized weights dequantized
(the kernels off, `afd.kernels.eager_ops`). Per position: |Δp| between the reference and the quantized model at the
reference's greedy token (the token `afd bench` scores), and whether the quantized model picks the dequantized
run's token where that run's top-2 margin (p1 - p2) is above `margin` (below it a tie breaks either way): the first
measures the quantization, the second the kernels' own arithmetic (activations in fp8 included). The reference's
top-1 probability is reported too: on random weights distributions are flat, and a small |Δp| then says less than
on a trained model. So is the scale the first figure reads on: where the reference computes in 16 bits, the same
weights in fp32 (eager ops) against it, the |Δp| that 16-bit arithmetic alone makes on these weights.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from afd.engine.engine import LocalExchange
from afd.model.batch import Batch


@dataclass(frozen=True)
class QuantNumerics:
    positions: int  # scored positions (every prompt position)
    mean_abs_dprob: float  # quantized vs reference, at the reference's greedy token
    max_abs_dprob: float
    decided: int  # positions whose dequantized-run top-2 margin is above `margin`
    argmax_equal: int  # of those, where the quantized model picks the dequantized run's token
    kernel_mean_abs_dprob: float  # quantized vs dequantized, at the dequantized run's greedy token
    mean_top1_prob: float  # the reference's, over all positions: how peaked the distributions are

    def as_dict(self) -> dict:
        return asdict(self)


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def prompt_probs(attn, ffn, prompt: list[int]) -> torch.Tensor:
    """Next-token probabilities at every position of `prompt` [len, V] fp32, one forward without a cache."""
    device = next(attn.parameters()).device
    batch = Batch(slots=[0], query_lens=[len(prompt)], context_lens=[0])
    ids = torch.tensor(prompt, device=device)
    with torch.inference_mode():
        hidden = attn(ids, torch.arange(len(prompt), device=device), batch, None, LocalExchange(ffn))
        return torch.softmax(attn.compute_logits(hidden), dim=-1)


def agreement(run: list[torch.Tensor], dense: list[torch.Tensor], margin: float) -> tuple[int, int]:
    """(positions where `dense`'s top-2 margin is above `margin`, of those where `run` picks `dense`'s token)."""
    decided = equal = 0
    for r, d in zip(run, dense, strict=True):
        top2 = d.topk(2, dim=-1)
        sure = top2.values[:, 0] - top2.values[:, 1] > margin
        decided += int(sure.sum())
        equal += int((sure & (top2.indices[:, 0] == r.argmax(dim=-1))).sum())
    return decided, equal


def compare(
    reference: list[torch.Tensor], quantized: list[torch.Tensor], dequantized: list[torch.Tensor], margin: float
) -> QuantNumerics:
    """The per-position comparison of three models' `prompt_probs` over the same prompts (one [len, V] tensor per
    prompt in each list)."""
    dprob, kernel_dprob, top1 = [], [], []
    for ref, run, dense in zip(reference, quantized, dequantized, strict=True):
        best = ref.max(dim=-1)
        dprob.append((best.values - run.gather(1, best.indices[:, None]).squeeze(1)).abs())
        greedy = dense.max(dim=-1)
        kernel_dprob.append((greedy.values - run.gather(1, greedy.indices[:, None]).squeeze(1)).abs())
        top1.append(best.values)
    decided, equal = agreement(quantized, dequantized, margin)
    d, k, t = torch.cat(dprob), torch.cat(kernel_dprob), torch.cat(top1)
    return QuantNumerics(d.numel(), float(d.mean()), float(d.max()), decided, equal, float(k.mean()), float(t.mean()))


def quantization_numerics(
    model: str | Path,
    *,
    quantization: str = "fp8",
    dtype: str = "bfloat16",
    device: str = "cuda",
    prompts: int = 16,
    prompt_len: int = 257,
    margin: float = 1e-2,
    seed: int = 0,
) -> dict:
    """`model` loaded as it is and with `quantization`, the same random prompts through both, and through each again
    with the kernels off; one model on the device at a time (the probabilities stay there). Besides `compare`'s
    figures, `unquantized_*`: the 16-bit model's kernels against its eager ops, the floor of what `argmax_equal`
    can reach; `fp32_mean_abs_dprob`: the 16-bit reference against the same weights in fp32."""
    from afd.bench.harness import release_device_memory
    from afd.kernels import eager_ops
    from afd.model.weights import load_attention_model, load_ffn_model, load_model_config

    vocab = load_model_config(model).vocab_size
    chosen = random_prompts(vocab, prompts, prompt_len, seed)
    probs: dict[str, list[torch.Tensor]] = {}
    for quant in (None, quantization):
        load = dict(dtype=dtype, device=device, seed=seed, quantization=quant)
        attn, ffn = load_attention_model(model, **load), load_ffn_model(model, **load)
        name = "reference" if quant is None else "quantized"
        probs[name] = [prompt_probs(attn, ffn, p) for p in chosen]
        with eager_ops():  # the same weights with the kernels off (the quantized ones: dequantized)
            probs["eager" if quant is None else "dequantized"] = [prompt_probs(attn, ffn, p) for p in chosen]
        del attn, ffn
        release_device_memory(device)
    result = compare(probs["reference"], probs["quantized"], probs["dequantized"], margin)
    # the same count for the 16-bit model's own kernels against its eager ops: how often kernels alone move a token
    decided16, equal16 = agreement(probs["reference"], probs["eager"], margin)
    floor = None
    if dtype not in ("float32", "fp32"):  # what 16-bit compute alone moves: fp32 against the 16-bit reference
        exact_load = dict(dtype="float32", device=device, seed=seed)
        attn, ffn = load_attention_model(model, **exact_load), load_ffn_model(model, **exact_load)
        with eager_ops():
            exact = [prompt_probs(attn, ffn, p) for p in chosen]
        del attn, ffn
        release_device_memory(device)
        floor = compare(exact, probs["reference"], probs["reference"], margin).mean_abs_dprob
    return {
        "model": str(model),
        "dtype": dtype,
        "device": device,
        "quantization": quantization,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "margin": margin,
        **result.as_dict(),
        "unquantized_decided": decided16,
        "unquantized_argmax_equal": equal16,
        "fp32_mean_abs_dprob": floor,  # the 16-bit reference against fp32, at fp32's greedy token (None in fp32)
    }
