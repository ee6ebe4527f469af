"""`afd export`: a preset written as a Hugging Face checkpoint directory, so that `transformers`, vLLM and
`afd generate --model DIR` load the same weights the preset builds.

The tokenizer is afd's byte-level one (`afd.serve.tokenizer.ByteTokenizer`) in `tokenizers`' format: ids 0-255 are
the UTF-8 bytes (a byte-level BPE vocabulary without merges), id 256 is EOS when the vocabulary is larger, and the
ids above are the tokens `<|N|>`. The chat template writes `role: content` lines, then `assistant:`, as afd serve
does for a model without one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from afd.model.presets import PRESETS
from afd.model.weights import preset_checkpoint, resolve_dtype

BYTE_IDS = 256
EOS_TEXT = "<|eos|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def byte_symbols() -> list[str]:
    """The printable character standing for each byte in a byte-level BPE vocabulary (GPT-2's convention, which
    `tokenizers`' ByteLevel pre-tokenizer and decoder use): printable Latin-1 stands for itself, the rest is moved
    above 255 in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(BYTE_IDS):
        if b in kept:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(BYTE_IDS + extra)
            extra += 1
    return [symbols[b] for b in range(BYTE_IDS)]


def eos_token_id(vocab_size: int) -> int | None:
    """Id 256 where the vocabulary has room for it (afd's byte-level convention), else no EOS."""
    return BYTE_IDS if vocab_size > BYTE_IDS else None


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    """`tokenizer.json` of the byte-level tokenizer for `vocab_size` ids."""
    vocab = {s: i for i, s in enumerate(byte_symbols()[:vocab_size])}
    eos = eos_token_id(vocab_size)
    added = []
    if eos is not None:
        vocab[EOS_TEXT] = eos
        added.append({"id": eos, "content": EOS_TEXT, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})  # fmt: skip
    for i in range(BYTE_IDS + 1, vocab_size):
        vocab[f"<|{i}|>"] = i
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },  # fmt: skip
    }


def export_preset(name: str, out_dir: str | Path, *, dtype: str = "float32", seed: int = 0) -> list[Path]:
    """Write preset `name` (weights from `seed`, stored in `dtype`) as a checkpoint in `out_dir`; returns the files.
    ValueError in one sentence for a name that is not a preset or a directory that is not empty."""
    from safetensors.torch import save_file

    if name not in PRESETS:
        raise ValueError(f"{name!r} is not a preset; afd export takes one of {', '.join(PRESETS)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{str(out)!r} exists and is not an empty directory")
    torch_dtype = resolve_dtype(dtype)
    raw = PRESETS[name]
    eos = eos_token_id(raw["vocab_size"])
    config = {
        **raw,
        "architectures": [ARCHITECTURES[raw["model_type"]]],
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": None,
        "num_key_value_heads": raw["num_attention_heads"],
        "hidden_act": "silu",
        "use_cache": True,
    }
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": None, "eos_token_id": eos, "do_sample": False},
        "tokenizer.json": tokenizer_json(raw["vocab_size"]),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOS_TEXT if eos is not None else None,
            "pad_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": raw["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    }
    written = []
    for file_name, content in files.items():
        (out / file_name).write_text(json.dumps(content, indent=2) + "\n")
        written.append(out / file_name)
    tensors = {k: t.contiguous() for k, t in preset_checkpoint(name, dtype=torch_dtype, seed=seed).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    written.append(out / "model.safetensors")
    return written
