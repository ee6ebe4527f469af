"""`afd bench step`'s floor: its arithmetic on DeepSeek-V2-Lite shapes (a meta-device model: no weights) matches the
estimate of the roofline."""

from __future__ import annotations

import pytest

from afd.bench.step import decode_step_bytes, expected_experts_touched, prefill_flops
from afd.model.weights import load_model_config


def test_floor_of_lite_matches_the_issue_estimate() -> None:
    """Issue 10: ~18 GB read per decode step at batch 8, 512 context; ~35 of 64 experts touched per layer;
    about 38 TFLOP for a prefill of 8 x 1024 tokens."""
    import torch

    config = load_model_config("deepseek-v2-lite")
    assert expected_experts_touched(64, 6, 8) == pytest.approx(35.0, abs=1.0)
    assert expected_experts_touched(64, 6, 256) == pytest.approx(64.0, abs=1e-6)
    with torch.device("meta"):
        from afd.model.attention_side import AttentionModel
        from afd.model.ffn_side import FFNModel

        attn = AttentionModel(config, dtype=torch.bfloat16).to(torch.bfloat16)
        ffn = FFNModel(config, dtype=torch.bfloat16).to(torch.bfloat16)
    step = decode_step_bytes(config, attn, ffn, 8, 512)
    assert 16e9 < step.total < 20e9
    assert step.latent_cache == 8 * 513 * 27 * 576 * 2
    assert 30e12 < prefill_flops(config, 8, 1024) < 45e12


def test_ragged_contexts_alternate_in_order() -> None:
    from afd.bench.step import ragged_contexts

    assert ragged_contexts(4, [512, 3584]) == [512, 3584, 512, 3584]
    assert ragged_contexts(5, [1, 2, 3]) == [1, 2, 3, 1, 2]
    assert sum(ragged_contexts(64, [512, 3584])) == 64 * 2048  # the uniform batch at the mean holds as much
