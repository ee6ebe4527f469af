"""`afd export`: a preset as a Hugging Face checkpoint that transformers loads (model and tokenizer) and that gives
afd's tokens, here and through `afd generate --model DIR`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import main_exit

from afd.engine.generate import generate

transformers = pytest.importorskip("transformers")

PROMPTS = [list("Hello, wörld".encode()), [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module", params=["tiny", "tiny-mla512"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    path = tmp_path_factory.mktemp("export") / name
    from afd.cli.main import main

    assert main(["export", "--model", name, str(path)]) == 0
    return name, path


def test_writes_the_checkpoint_files(exported: tuple[str, Path]) -> None:
    _, path = exported
    files = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert {p.name for p in path.iterdir()} == files
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"]


def test_transformers_gives_afds_tokens(exported: tuple[str, Path]) -> None:
    name, path = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = generate(name, PROMPTS, max_new_tokens=8)
    for prompt, out in zip(PROMPTS, want, strict=True):
        got = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert got[0, len(prompt) :].tolist() == out.token_ids
    from_dir = generate(str(path), PROMPTS, max_new_tokens=8)
    assert [o.token_ids for o in from_dir] == [o.token_ids for o in want]


def test_the_tokenizer_is_afds_byte_level_one(exported: tuple[str, Path]) -> None:
    name, path = exported
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "Hello, wörld"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == "user: hi\nassistant:"
    if name == "tiny":  # 256 ids: the bytes, no EOS
        assert len(tok) == 256 and tok.eos_token_id is None
    else:  # id 256 is EOS, the ids above read back as <|N|>
        assert tok.eos_token_id == 256 and tok.decode([104, 300]) == "h<|300|>"


def test_refuses_what_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = main_exit(capsys, "export", "--model", "no-such-preset", str(tmp_path / "a"))
    assert code == 2 and "is not a preset" in err and err.count("\n") == 1
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    code, err = main_exit(capsys, "export", "--model", "tiny", str(tmp_path / "b"))
    assert code == 2 and "not an empty directory" in err
