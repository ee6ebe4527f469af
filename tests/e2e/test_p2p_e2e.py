"""p2p end to end: real rank processes over gloo, started by the launcher, against the reference engine."""

from __future__ import annotations

import pytest
from helpers.e2e import MAX_NEW_TOKENS, MODEL, PROMPTS, assert_matches_reference, reference

from afd.config import parse_config
from afd.runtime.launch import free_port, launch
from afd.runtime.spec import RunSpec

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)

TOPOLOGIES = [(1, 1), (2, 2), (3, 2), (1, 2), (1, 4), (5, 2), (2, 3)]


def run_p2p(num_attn: int, num_ffn: int, gate_on_attention: bool, prompts=PROMPTS):
    config = parse_config(
        {
            "connector": "p2p",
            "num_attention_ranks": num_attn,
            "num_ffn_ranks": num_ffn,
            "port": free_port(),
            "compute_gate_on_attention": gate_on_attention,
            "connector_extra_config": {"timeout_s": 60},
        }
    )
    spec = RunSpec(model=MODEL, max_new_tokens=MAX_NEW_TOKENS, prompt_logprobs=True, timeout_s=120)
    outputs, _ = launch(config, spec, prompts)
    return outputs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("gate_on_attention", [True, False], ids=["gate-attn", "gate-ffn"])
@pytest.mark.parametrize("num_attn, num_ffn", TOPOLOGIES, ids=[f"{a}A{f}F" for a, f in TOPOLOGIES])
def test_p2p_matches_reference(num_attn: int, num_ffn: int, gate_on_attention: bool) -> None:
    outputs = run_p2p(num_attn, num_ffn, gate_on_attention)
    assert_matches_reference(outputs, reference(gate_on_attention))


@pytest.mark.timeout(150)
def test_zero_share_ffn_rank() -> None:
    """1A4F with one single-token prompt: 1 token over 4 FFN members leaves three with nothing at all."""
    prompts = [[42]]
    outputs = run_p2p(1, 4, True, prompts)
    from afd.engine.generate import generate

    ref = generate(MODEL, prompts, max_new_tokens=MAX_NEW_TOKENS, prompt_logprobs=True)
    assert_matches_reference(outputs, ref)
