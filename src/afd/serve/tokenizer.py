"""Text <-> token ids for `afd serve`: a checkpoint's own tokenizer, or a byte-level one for the presets.

A checkpoint directory with `tokenizer.json` / `tokenizer_config.json` gets its own tokenizer through
`transformers` (local files only, never the network), including its chat template. The presets have
random weights and no tokenizer: `ByteTokenizer` maps UTF-8 bytes to ids 0..255, so that
`afd serve --model tiny` takes text. Ids past the bytes are not text: id 256 is EOS where the vocabulary
has it, every other id reads back as `<|N|>`.

Streaming detokenization never emits broken UTF-8: a decoder holds back bytes (or tokens) that do not
yet form whole characters and releases them when the next token completes them (or at `flush`).
"""

from __future__ import annotations

import codecs
import json
import logging
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

BYTE_IDS = 256
PLAIN_TEMPLATE_HINT = "a plain 'role: content' template"
REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """Text or messages this tokenizer cannot turn into ids (one sentence, an HTTP 400)."""


class Decoder(Protocol):
    def push(self, token_id: int) -> str:
        """The text this token completes (may be '' while bytes of a character are still missing)."""
        ...

    def flush(self) -> str:
        """Whatever is held back, as text (incomplete bytes become U+FFFD)."""
        ...


class Tokenizer(Protocol):
    vocab_size: int
    stop_token_ids: list[int]  # end generation (EOS), unless the request says ignore_eos

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decoder(self) -> Decoder: ...

    def token_text(self, token_id: int) -> str:
        """The token as a string for `logprobs` (a byte that is not printable ASCII reads `<0xHH>`)."""
        ...

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The prompt ids of a chat, ending where the assistant's reply begins."""
        ...


def utf8(text: str) -> bytes:
    """`text` as UTF-8; TokenizerError when it cannot be (a lone surrogate such as "\\ud800", which JSON can carry)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        raise TokenizerError(f"the text holds U+{bad:04X}, a lone surrogate, which is not Unicode text") from None


def plain_chat_text(messages: list[dict]) -> str:
    """The template of a model without one: `role: content` lines, then `assistant:`."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


# ---------------------------------------------------------------- byte level (presets)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 256 is EOS when the vocabulary is larger than 256, else there is no EOS
    (the `tiny` preset's 256 ids are exactly the bytes: it stops at max_tokens or a stop string). A
    vocabulary smaller than 256 takes only the bytes below its size."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = BYTE_IDS if vocab_size > BYTE_IDS else None
        self.stop_token_ids = [self.eos_token_id] if self.eos_token_id is not None else []

    def encode(self, text: str) -> list[int]:
        ids = list(utf8(text))
        if self.vocab_size < BYTE_IDS:
            bad = next((b for b in ids if b >= self.vocab_size), None)
            if bad is not None:
                raise TokenizerError(
                    f"the text has the byte 0x{bad:02X}, outside this model's byte-level vocabulary of "
                    f"{self.vocab_size} ids; send token ids instead"
                )
        return ids

    def decode(self, ids: list[int]) -> str:
        decoder = self.decoder()
        return "".join(decoder.push(t) for t in ids) + decoder.flush()

    def decoder(self) -> ByteDecoder:
        return ByteDecoder(self.eos_token_id)

    def token_text(self, token_id: int) -> str:
        if token_id < BYTE_IDS:
            return chr(token_id) if 0x20 <= token_id < 0x7F else f"<0x{token_id:02X}>"
        return "<|eos|>" if token_id == self.eos_token_id else f"<|{token_id}|>"

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.encode(plain_chat_text(messages))


class ByteDecoder:
    """Bytes through an incremental UTF-8 decoder (it holds back an incomplete character by itself)."""

    def __init__(self, eos_token_id: int | None) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._eos = eos_token_id

    def push(self, token_id: int) -> str:
        if token_id < BYTE_IDS:
            return self._utf8.decode(bytes([token_id]))
        text = self.flush()  # a non-byte token ends any pending character
        return text if token_id == self._eos else text + f"<|{token_id}|>"

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---------------------------------------------------------------- a checkpoint's own tokenizer
class HFTokenizer:
    """A checkpoint's tokenizer through `transformers` (its BOS rules, special tokens and chat template)."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizerError(
                f"{str(path)!r} has a tokenizer, which needs the transformers library: pip install transformers"
            ) from None
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # transformers raises many types for one unreadable file
            raise TokenizerError(f"the tokenizer of {str(path)!r} cannot be loaded: {exc}") from None
        self.vocab_size = vocab_size
        stops = [self._tok.eos_token_id] if self._tok.eos_token_id is not None else []
        self.stop_token_ids = sorted(set(stops + _generation_eos(path)))
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        utf8(text)
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.decode)

    def token_text(self, token_id: int) -> str:
        token = self._tok.convert_ids_to_tokens(token_id)
        return token if isinstance(token, str) else f"<|{token_id}|>"

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            return self.encode(plain_chat_text(messages))
        for m in messages:
            utf8(m["content"])
        try:
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may raise on messages it does not accept (e.g. role order)
            raise TokenizerError(f"the model's chat template refused these messages: {exc}") from None
        return list(self._tok.encode(text, add_special_tokens=False))  # the template wrote the BOS itself


class IncrementalDecoder:
    """Decode a growing list of ids piece by piece (tokens may merge into characters or spaces only with
    their neighbours): re-decode a short window and emit only text that ends in a whole character."""

    def __init__(self, decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: text before it is settled
        self._read = 0  # ids whose text has been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""  # an incomplete character (or nothing new yet): wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


def _generation_eos(path: Path) -> list[int]:
    """`eos_token_id` of `generation_config.json` (an int or a list), which vLLM also stops at."""
    try:
        value = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model: str, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer when its directory has one, else the byte-level tokenizer (presets,
    and checkpoints saved without tokenizer files: those take text as bytes, and token ids as given)."""
    path = Path(model)
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return HFTokenizer(path, vocab_size)
    if path.is_dir():
        logger.warning("%s has no tokenizer files: text is read as UTF-8 bytes (ids 0..255)", model)
    return ByteTokenizer(vocab_size)
