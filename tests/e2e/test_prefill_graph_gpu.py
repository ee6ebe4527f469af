"""The GPU half of tests/unit/test_prefill_graph.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.e2e import MODEL
from helpers.graph_fakes import RealRowsOnly

from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.graphs.prefill import token_buckets
from afd.model.weights import load_attention_model, load_ffn_model

# --- on the device -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("bfloat16", "fp8")])
def test_replayed_prefill_graphs_equal_eager_steps(dtype: str, quantization: str | None) -> None:
    """Fresh prompts, chunked prompts and steps mixed with decodes through replayed graphs (captured for every
    bucket at once, as the warm-up does) against the eager engine: the same tokens, logprobs within 1e-4 (fp32) or
    5e-2 (bf16, where padding changes the GEMMs' shapes and so their rounding), the exchange handed the same rows;
    with FP8 linears too (their dequantization and kernels captured in the graphs)."""
    models = (
        load_attention_model(MODEL, dtype=dtype, device="cuda", quantization=quantization),
        load_ffn_model(MODEL, dtype=dtype, device="cuda", quantization=quantization),
    )
    rng = random.Random(1)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (130, 7, 290, 1, 45, 600, 3, 260, 1000, 17)]

    def run(graphs: bool):
        attn, ffn = models
        exchange = RealRowsOnly(LocalExchange(ffn))
        engine = Engine(attn, exchange, 512, block_size=16, max_num_seqs=16, num_blocks=1024)
        if not graphs:
            engine.prefill_graphs = []
        else:
            assert engine.prefill_graphs and engine.prefill_graphs[0].buckets == token_buckets(512)
            with torch.inference_mode():
                engine.prefill_graphs[0].capture_all()
            assert not engine.prefill_graphs[0].disabled, "a capture failed (its traceback is in the log)"
            assert engine.prefill_graphs[0].captured == token_buckets(512)
            assert engine.prefill_graphs[0].captured_cores_inside == token_buckets(512)
        for p in prompts:
            engine.add(Request(list(p), 6, prompt_logprobs=True))
        outputs = engine.run()
        if graphs:  # steps of decodes and fresh prompts ran their attention cores inside the pieces
            assert engine.prefill_graphs[0].steps_cores_inside > 0
        return outputs, exchange.rows_seen

    want, want_rows = run(False)
    got, rows = run(True)
    assert rows == want_rows
    tol = 1e-4 if dtype == "float32" else 5e-2
    report = [_differences(g, w) for g, w in zip(got, want, strict=True)]
    shown = "\n".join(f"request {i}: {r}" for i, r in enumerate(report))
    assert all(r["diverges_at"] is None for r in report), f"tokens differ:\n{shown}"
    assert all(max(r["logprob"], r["prompt_logprob"]) <= tol for r in report), f"logprobs beyond {tol}:\n{shown}"


def _differences(got, want) -> dict:
    """Where two runs' generated tokens first differ (None: nowhere), the largest |Δ logprob| before that and over
    the prompt, and the tokens."""
    same = [a == b for a, b in zip(got.token_ids, want.token_ids, strict=True)]
    diverges_at = same.index(False) if not all(same) else None
    upto = len(same) if diverges_at is None else diverges_at
    pairs = zip(got.logprobs[:upto], want.logprobs[:upto], strict=True)
    logprob = max((abs(a - b) for a, b in pairs), default=0.0)
    prompt = zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True)  # a one-token prompt scores none
    prompt_logprob = max((abs(a - b) for a, b in prompt), default=0.0)
    return {"diverges_at": diverges_at, "logprob": logprob, "prompt_logprob": prompt_logprob,
            "tokens": (got.token_ids, want.token_ids)}  # fmt: skip
