"""`afd.bench.quant_numerics`: the per-position comparison on hand-made distributions, and FP8 against fp32 on the
tiny model (CPU, one forward per prompt)."""

from __future__ import annotations

import pytest
import torch

from afd.bench.quant_numerics import agreement, compare, quantization_numerics


def test_compare_on_hand_made_distributions() -> None:
    ref = torch.tensor([[0.7, 0.2, 0.1], [0.40, 0.395, 0.205], [0.1, 0.1, 0.8]])  # 3 positions, vocab 3
    run = torch.tensor([[0.6, 0.3, 0.1], [0.39, 0.40, 0.21], [0.1, 0.2, 0.7]])
    dense = torch.tensor([[0.6, 0.3, 0.1], [0.41, 0.40, 0.19], [0.3, 0.1, 0.6]])
    got = compare([ref], [run], [dense], margin=1e-2)
    assert got.positions == 3
    # the reference's greedy tokens 0, 0, 2: |0.7 - 0.6|, |0.40 - 0.39|, |0.8 - 0.7|
    assert got.mean_abs_dprob == pytest.approx((0.1 + 0.01 + 0.1) / 3)
    assert got.max_abs_dprob == pytest.approx(0.1)
    # the dequantized run's margins 0.3, 0.01 (a tie: not decided), 0.3; its tokens 0 and 2 = the quantized run's
    assert (got.decided, got.argmax_equal) == (2, 2)
    # at the dequantized run's greedy tokens 0, 0, 2: |0.6 - 0.6|, |0.41 - 0.39|, |0.6 - 0.7|
    assert got.kernel_mean_abs_dprob == pytest.approx((0.0 + 0.02 + 0.1) / 3)
    assert got.mean_top1_prob == pytest.approx((0.7 + 0.40 + 0.8) / 3)
    flipped = compare([ref], [run[:, [1, 0, 2]]], [dense], margin=1e-2)
    assert (flipped.decided, flipped.argmax_equal) == (2, 1)


def test_agreement_counts_decided_positions_and_their_equal_tokens() -> None:
    dense = [torch.tensor([[0.6, 0.3, 0.1], [0.41, 0.40, 0.19], [0.3, 0.1, 0.6]])]
    run = [torch.tensor([[0.5, 0.4, 0.1], [0.30, 0.60, 0.10], [0.5, 0.1, 0.4]])]
    assert agreement(run, dense, margin=1e-2) == (2, 1)  # position 1 undecided; position 2 differs


def test_a_model_against_itself_is_exact() -> None:
    probs = torch.softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(0)), dim=-1)
    same = compare([probs], [probs.clone()], [probs.clone()], margin=0.0)
    assert same.mean_abs_dprob == same.kernel_mean_abs_dprob == 0.0 and same.argmax_equal == same.decided == 5


@pytest.mark.timeout(60)
def test_fp8_against_fp32_on_the_tiny_model() -> None:
    """On CPU the quantized model runs the dequantized path, so its tokens are the dequantized run's everywhere."""
    got = quantization_numerics("tiny", dtype="float32", device="cpu", prompts=3, prompt_len=33)
    assert got["positions"] == 3 * 33
    # quantized weights move the greedy token's probability (top-1 ~0.36 on tiny's random weights: measured ~0.08)
    assert 0.0 < got["mean_abs_dprob"] < 0.2
    assert 0 < got["decided"] <= got["positions"] and got["argmax_equal"] == got["decided"]
    assert got["kernel_mean_abs_dprob"] == 0.0
    assert got["unquantized_decided"] > 0 and got["unquantized_argmax_equal"] == got["unquantized_decided"]
    assert got["fp32_mean_abs_dprob"] is None  # the reference is fp32 itself


@pytest.mark.timeout(120)
def test_a_16_bit_reference_is_set_beside_fp32() -> None:
    """In bfloat16 the same weights also run in fp32: the |Δp| that 16-bit compute alone makes, the scale the
    quantization's figure reads on; both nonzero, and bf16's rounding of every activation is smaller than fp8's
    rounding of every weight."""
    got = quantization_numerics("tiny", dtype="bfloat16", device="cpu", prompts=2, prompt_len=17)
    assert 0.0 < got["fp32_mean_abs_dprob"] < got["mean_abs_dprob"]
