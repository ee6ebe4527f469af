"""FP8 weights through the connectors' processes: an FP8 checkpoint (DeepSeek-V3's released format) launched with
p2p and async at several A:F equals the single-process reference; `--quantization fp8` reaches every rank (an fp32
checkpoint launched with it equals the same weights shipped in FP8); a bad quantization_config is one sentence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.e2e import Leftovers, assert_matches_reference
from helpers.fp8 import save_fp32_model, write_fp8

from afd.config import parse_config
from afd.engine.generate import generate
from afd.runtime.launch import free_port, launch
from afd.runtime.spec import RunSpec

pytest.importorskip("transformers")

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 19, 23, 11], [4, 8], [100, 3, 77, 12, 9, 50], [1]]
MAX_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_launch")
    src = save_fp32_model(root / "fp32")
    return {
        "fp32": src,
        "fp8_16": write_fp8(src, root / "fp8_16", (16, 16)),
        "fp8_128_fp32_rest": write_fp8(src, root / "fp8_128", (128, 128), others=None),
    }


def _launch(model: Path, connector: str, num_attention: int, num_ffn: int, quantization: str | None = None) -> list:
    config = parse_config(
        {
            "connector": connector,
            "port": free_port(),
            "num_attention_ranks": num_attention,
            "num_ffn_ranks": num_ffn,
        }
    )
    spec = RunSpec(
        model=str(model),
        quantization=quantization,
        max_new_tokens=MAX_NEW_TOKENS,
        prompt_logprobs=True,
        max_num_batched_tokens=64,
        timeout_s=120,
    )
    leftovers = Leftovers()
    try:
        outputs, _ = launch(config, spec, PROMPTS)
        leftovers.check()
    finally:
        leftovers.cleanup()
    return outputs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("connector, num_attention, num_ffn", [("p2p", 1, 2), ("p2p", 2, 1), ("async", 2, 2)])
def test_fp8_checkpoint_through_connectors_equals_the_reference(checkpoints, connector, num_attention, num_ffn):
    model = checkpoints["fp8_16"]
    reference = generate(model, PROMPTS, max_new_tokens=MAX_NEW_TOKENS, prompt_logprobs=True)
    assert_matches_reference(_launch(model, connector, num_attention, num_ffn), reference)


@pytest.mark.timeout(300)
def test_quantization_flag_reaches_every_rank(checkpoints):
    """async 1A3F on the fp32 checkpoint with --quantization fp8 equals the same weights shipped in FP8 (in-process
    reference), within 1e-5: every FFN rank quantized its experts, the attention rank its projections."""
    shipped = generate(checkpoints["fp8_128_fp32_rest"], PROMPTS, max_new_tokens=MAX_NEW_TOKENS, prompt_logprobs=True)
    outputs = _launch(checkpoints["fp32"], "async", 1, 3, quantization="fp8")
    for got, want in zip(outputs, shipped, strict=True):
        assert got.token_ids == want.token_ids
        pairs = list(zip(got.logprobs, want.logprobs, strict=True))
        pairs += list(zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True))
        assert max(abs(a - b) for a, b in pairs) <= 1e-5


@pytest.mark.timeout(120)
def test_cli_generate_fp8_and_a_refused_config(checkpoints, tmp_path):
    """`afd generate` on the FP8 checkpoint equals the library; a gptq config is refused in one sentence, exit 2."""
    ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
    cmd = [sys.executable, "-m", "afd", "generate", "--prompt-ids", ids, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    proc = subprocess.run([*cmd, "--model", str(checkpoints["fp8_16"]), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    want = generate(checkpoints["fp8_16"], PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    assert [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]] == [o.token_ids for o in want]
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((checkpoints["fp32"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    proc = subprocess.run([*cmd, "--model", str(bad), "--connector", "p2p"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "quant_method 'awq'" in proc.stderr
