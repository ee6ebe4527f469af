"""FP8 weights in DeepSeek-V3's released format, in process: the block recipe, transformers as the oracle on the
dequantized weights (16 x 16 and 128 x 128 blocks, ragged edges), `quantization="fp8"` against the same weights
shipped in FP8, role-scoped reads of weights and scales, FP8 bytes in the estimates, and refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import main_exit
from helpers.fp8 import block_dequantize, block_quantize, save_fp32_model, write_dequantized, write_fp8

import afd.model.weights as weights
from afd.engine.engine import LocalExchange
from afd.engine.generate import generate
from afd.model.batch import Batch
from afd.model.fp8 import FP8_DTYPE, dequantize, quantize
from afd.model.weights import ffn_keys, load_attention_model, load_ffn_model, load_model_config
from afd.runtime import resources

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3, 99, 42, 7, 61], [11, 2, 80], [63, 64, 1, 9, 33, 25, 70, 71, 4, 13, 50], [8]]
BLOCKS = [(16, 16), (128, 128)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """fp32 source; per block: the FP8 checkpoint (bf16 rest, as released) and what it means in fp32; and the source
    shipped in FP8 with 128 x 128 blocks and its other tensors kept fp32 (to compare with online quantization)."""
    root = tmp_path_factory.mktemp("fp8")
    src = save_fp32_model(root / "fp32")
    out: dict = {"fp32": src, "fp8_fp32_rest": write_fp8(src, root / "fp8_fp32_rest", (128, 128), others=None)}
    for b in BLOCKS:
        fp8 = write_fp8(src, root / f"fp8_{b[0]}", b)
        out[b] = (fp8, write_dequantized(fp8, root / f"deq_{b[0]}"))
    return out


@pytest.mark.parametrize("shape", [(40, 144), (200, 136), (3, 160, 40)])
@pytest.mark.parametrize("block", [(16, 16), (128, 128), (16, 32)])
def test_block_recipe_matches_the_format(shape, block) -> None:
    """afd's vectorized quantize/dequantize equal the block-by-block definition, bit for bit, ragged edges too."""
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.2
    q, scale = quantize(w, block)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    for e in range(shape[0] if len(shape) == 3 else 1):
        we, qe, se = (w[e], q[e], scale[e]) if len(shape) == 3 else (w, q, scale)
        want_q, want_s = block_quantize(we, block)
        assert torch.equal(se, want_s) and torch.equal(qe.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(dequantize(qe, se, block), block_dequantize(want_q, want_s, block))
    assert (dequantize(q, scale, block) - w).abs().max() <= w.abs().max() / 16  # 3 mantissa bits


@torch.no_grad()
def _logits(path: Path, **load) -> torch.Tensor:
    attn, ffn = load_attention_model(path, **load), load_ffn_model(path, **load)
    flat = [t for p in PROMPTS for t in p]
    positions = [i for p in PROMPTS for i in range(len(p))]
    batch = Batch(slots=list(range(len(PROMPTS))), query_lens=[len(p) for p in PROMPTS], context_lens=[0] * 4)
    return attn.compute_logits(attn(torch.tensor(flat), torch.tensor(positions), batch, None, LocalExchange(ffn)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(checkpoints, block) -> None:
    """fp32 compute within 1e-4 of transformers run on the weights the FP8 checkpoint means; greedy tokens equal."""
    fp8, dequantized = checkpoints[block]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in PROMPTS])  # [T, V]
    got = _logits(fp8)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=1e-4, rtol=0)
    # the scales matter: the same fp8 values without them are a different model
    assert (_logits(dequantized) - got).abs().max() < 1e-4
    outs = generate(fp8, PROMPTS, max_new_tokens=4)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = list(prompt)
        for _ in range(4):
            with torch.no_grad():
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt) :]


@pytest.mark.timeout(60)
def test_weights_stay_fp8_in_the_model(checkpoints) -> None:
    fp8, _ = checkpoints[(16, 16)]
    attn, ffn = load_attention_model(fp8), load_ffn_model(fp8, expert_range=(2, 5))
    proj = attn.layers[1].self_attn.q_b_proj
    assert proj.weight.dtype == FP8_DTYPE and proj.weight_scale_inv.shape == (-(-96 // 16), -(-136 // 16))
    experts = ffn.layers["1"].experts
    assert experts.w13.dtype == experts.w2.dtype == FP8_DTYPE
    assert experts.w13_scale_inv.shape == (3, 2 * 3, 9) and experts.w2_scale_inv.shape == (3, 9, 3)
    assert attn.lm_head.weight.dtype == attn.embed_tokens.weight.dtype == torch.float32
    assert attn.layers[1].gate.weight.dtype == torch.float32
    assert ffn.layers["1"].shared_experts.down_proj.weight.dtype == FP8_DTYPE


@pytest.mark.timeout(60)
def test_ffn_rank_reads_only_its_experts_weights_and_scales(checkpoints, monkeypatch) -> None:
    fp8, _ = checkpoints[(128, 128)]
    reads: list[str] = []
    real = weights._Checkpoint.iter

    def recording(self, keys, device):
        reads.extend(keys)
        return real(self, keys, device)

    monkeypatch.setattr(weights._Checkpoint, "iter", recording)
    config = load_model_config(fp8)
    load_ffn_model(fp8, expert_range=(3, 6))
    assert sorted(reads) == sorted(ffn_keys(config, expert_range=(3, 6)))
    experts = [k for k in reads if ".mlp.experts." in k]
    assert {int(k.split(".")[5]) for k in experts} == {3, 4, 5}
    assert sum(k.endswith("weight_scale_inv") for k in experts) == 2 * 3 * 3  # 2 MoE layers x 3 experts x 3
    assert not any("self_attn" in k or "embed" in k or "lm_head" in k for k in reads)


@pytest.mark.timeout(120)
def test_online_quantization_equals_the_same_weights_shipped_in_fp8(checkpoints) -> None:
    """`quantization="fp8"` on the fp32 checkpoint gives the FP8 checkpoint's tensors bit for bit, hence its outputs."""
    fp32, shipped = checkpoints["fp32"], checkpoints["fp8_fp32_rest"]
    online = load_ffn_model(fp32, quantization="fp8")
    loaded = load_ffn_model(shipped)
    for (name, a), (_, b) in zip(online.named_parameters(), loaded.named_parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    want = generate(shipped, PROMPTS, max_new_tokens=4, prompt_logprobs=True)
    got = generate(fp32, PROMPTS, max_new_tokens=4, prompt_logprobs=True, quantization="fp8")
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) <= 1e-5
        prompt_deltas = [abs(a - b) for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True)]
        assert max(prompt_deltas, default=0.0) <= 1e-5
    # and it is a different model from the fp32 one (the flag is not a no-op)
    plain = generate(fp32, PROMPTS, max_new_tokens=4, prompt_logprobs=True)
    deltas = [abs(a - b) for p, g in zip(plain, got, strict=True) for a, b in zip(p.logprobs, g.logprobs, strict=True)]
    assert max(deltas) > 1e-4


@pytest.mark.timeout(60)
def test_presets_quantize_at_load() -> None:
    config = load_model_config("tiny", "fp8")
    assert config.fp8_block == (128, 128) and load_model_config("tiny").fp8_block is None
    ffn = load_ffn_model("tiny", quantization="fp8", dtype="bfloat16")
    assert ffn.layers["1"].experts.w13.dtype == FP8_DTYPE
    out = generate("tiny", [[1, 2, 3]], max_new_tokens=3, quantization="fp8")
    assert len(out[0].token_ids) == 3


@pytest.mark.timeout(60)
def test_the_absorbed_decode_reads_kv_b_proj_dequantized_once_at_load(checkpoints, monkeypatch) -> None:
    """MLA's decode reads kv_b_proj whole every step: an FP8 one is dequantized once, at load (so the KV cache is
    sized after it), and decode steps never expand it again; the tokens stay those of the per-call path."""
    import afd.model.fp8 as fp8_module
    from afd.engine.generate import generate

    fp8, _ = checkpoints[(16, 16)]
    attn = load_attention_model(fp8)
    kv_b = attn.layers[0].self_attn.kv_b_proj
    assert kv_b.dense is not None and kv_b.dense.dtype == torch.float32
    assert torch.equal(kv_b.dense, kv_b.dequantized(torch.float32))
    assert attn.layers[0].self_attn.q_b_proj.dense is None  # only the projection used whole keeps a copy
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]  # two decodes a step: the batched, absorbed path
    want = [o.token_ids for o in generate(fp8, prompts, max_new_tokens=6)]
    calls: list[tuple[int, ...]] = []
    real = fp8_module.dequantize

    def counting(weight, *args, **kwargs):
        calls.append(tuple(weight.shape))
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(fp8_module, "dequantize", counting)
    assert [o.token_ids for o in generate(fp8, prompts, max_new_tokens=6)] == want
    loads = calls.count(tuple(kv_b.weight.shape))
    monkeypatch.setattr(fp8_module.FP8Linear, "keep_dense", lambda self, dtype: None)  # the per-call path
    calls.clear()
    assert [o.token_ids for o in generate(fp8, prompts, max_new_tokens=6)] == want
    per_call = calls.count(tuple(kv_b.weight.shape))
    assert per_call >= loads + 5  # without the kept copy, each of the 5 decode steps expands it again


def test_a_kept_dense_weight_serves_every_call(checkpoints, monkeypatch) -> None:
    """kv_b_proj, kept dequantized for the absorbed decode, multiplies prompts' latents by that copy too, even where
    the FP8 kernel would run (which quantizes the rows): a sequence's keys and values are one function of its
    latents whichever form of attention its step takes."""
    import afd.kernels.fp8_linear as kfl
    import afd.model.fp8 as fp8_module

    fp8, _ = checkpoints[(16, 16)]
    kv_b = load_attention_model(fp8).layers[0].self_attn.kv_b_proj
    monkeypatch.setattr(fp8_module, "_fp8_linear_enabled", lambda device, dtype: True)
    monkeypatch.setattr(fp8_module, "block_in_kernels", lambda block: True)
    monkeypatch.setattr(kfl, "fp8_linear", lambda *a, **k: pytest.fail("the kernel ran"))
    x = torch.randn(7, kv_b.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kv_b(x), torch.nn.functional.linear(x, kv_b.dense))
    kv_b.dense = None  # without the copy, the kernel
    with pytest.raises(pytest.fail.Exception, match="the kernel ran"):
        kv_b(x)


def test_estimates_count_fp8_bytes() -> None:
    lite = load_model_config("deepseek-v2-lite")
    bf16 = resources.ffn_weight_bytes(lite, "bfloat16")
    fp8 = resources.ffn_weight_bytes(lite.with_quantization("fp8"), "bfloat16")
    assert 0.49 < fp8 / bf16 < 0.52  # one byte per weight plus a 4-byte scale per 128 x 128 block
    v3 = load_model_config("deepseek-v3")  # released in FP8: its quantization_config is read
    assert v3.fp8_block == (128, 128)
    total = resources.ffn_weight_bytes(v3, "bfloat16") + resources.attention_weight_bytes(v3, "bfloat16")
    assert 0.6e12 < total < 0.75e12  # ~671 B parameters at about one byte each


def test_bench_step_floor_counts_fp8_bytes() -> None:
    from afd.bench.step import decode_step_bytes
    from afd.model.attention_side import AttentionModel
    from afd.model.ffn_side import FFNModel

    lite = load_model_config("deepseek-v2-lite")
    steps = []
    for config in (lite, lite.with_quantization("fp8")):
        with torch.device("meta"):
            attn, ffn = AttentionModel(config, dtype=torch.bfloat16), FFNModel(config, dtype=torch.bfloat16)
        for model in (attn, ffn):  # as the loader leaves them: FP8 weights, fp32 scales and router, the rest bf16
            for name, p in model.named_parameters():
                if p.dtype == torch.float32 and not name.endswith(("_scale_inv", ".gate.weight")):
                    p.data = p.data.to(torch.bfloat16)
        steps.append(decode_step_bytes(config, attn, ffn, 8, 512))
    assert 0.49 < steps[1].routed_experts / steps[0].routed_experts < 0.52
    assert steps[1].dense_weights < 0.75 * steps[0].dense_weights


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128]"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "two positive ints"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["x"]}, "'ignored_layers'"),
        ("fp8", "must be an object"),
    ],
)
def test_unsupported_quantization_config_is_refused_in_one_sentence(checkpoints, tmp_path, capsys, qc, message):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints[(16, 16)][0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match="quantization_config"):
        load_model_config(path)
    code, err = main_exit(capsys, "generate", "--model", str(path), "--prompt-ids", "1,2")
    assert code == 2 and message in err and "Traceback" not in err
    assert err.count("\n") == 1, err


def test_float8_tensors_without_a_quantization_config_are_refused(checkpoints, tmp_path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints[(16, 16)][0], path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ships 'model.layers.0.self_attn.* in float8_e4m3fn"):
        load_attention_model(path)


def test_a_missing_scale_is_refused(checkpoints, tmp_path) -> None:
    from helpers.fp8 import read_all, save_shards

    src = checkpoints[(16, 16)][0]
    tensors = read_all(src)
    del tensors["model.layers.2.mlp.experts.4.down_proj.weight_scale_inv"]
    save_shards(tensors, tmp_path / "ckpt", json.loads((src / "config.json").read_text()))
    with pytest.raises(ValueError, match="lacks 1 tensors|without its"):
        load_ffn_model(tmp_path / "ckpt")
    load_ffn_model(tmp_path / "ckpt", expert_range=(0, 4))  # a rank without expert 4 never needs it
