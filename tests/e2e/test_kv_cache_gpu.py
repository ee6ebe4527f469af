"""The GPU half of tests/unit/test_kv_cache.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import pytest
import torch

from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.generate import generate
from afd.model.weights import load_attention_model, load_ffn_model

BLOCK = 4
# Lengths around multiples of the block size: one short of, exactly at and one past a block boundary.
PROMPTS = [[3, 1, 4], [1, 5, 9, 2], [6, 5, 3, 5, 8], [9, 7, 9, 3, 2, 3, 8], [4, 6, 2, 6, 4, 3, 3, 8], [2] * 9, [7]]


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_paged_decode_is_exact_sized_from_memory_and_never_syncs_the_host():
    """On the GPU: decode across block boundaries equals recompute; the pool is sized within
    gpu_memory_utilization of the GPU; neither the cache nor the attention layers block on the device
    (the engine's one device->host copy of the sampled tokens is the only sync outside the MoE routing)."""
    import warnings

    attn = load_attention_model("tiny", device="cuda")
    engine = Engine(attn, LocalExchange(load_ffn_model("tiny", device="cuda")), 64, block_size=BLOCK)
    free, total = torch.cuda.mem_get_info()
    assert engine.kv_cache.block_tables.is_cuda and engine.kv_cache.nbytes < 0.9 * total
    for p in PROMPTS:
        engine.add(Request(list(p), 7, prompt_logprobs=True))
    engine.step()
    engine.step()  # one batched decode step past the prefill, before the one watched
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    where = [w.filename for w in caught if "synchroniz" in str(w.message)]
    assert not [f for f in where if f.endswith(("kv_cache.py", "model.py"))]
    # the sampled tokens' copy is pinned and asynchronous, waited on by an event: no stream sync in the engine
    assert sum(f.endswith("engine.py") for f in where) == 0
    outs = engine.run()
    for out in outs:
        (full,) = generate(
            "tiny", [out.prompt_ids + out.token_ids], max_new_tokens=0, prompt_logprobs=True, device="cuda"
        )
        assert full.prompt_logprobs[len(out.prompt_ids) :] == pytest.approx(out.logprobs, abs=1e-4)
