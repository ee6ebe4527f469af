"""`TextTemplate`: a token's chunk filled into the choice's chunk serialized once equals, byte for byte, the chunk
serialized anew (completions and chat), for texts with quotes, escapes, control characters and non-ASCII."""

from __future__ import annotations

import random

import pytest

from afd.serve.protocol import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    sse,
)
from afd.serve.responses import TEXT_MARK, TextTemplate

TEXTS = ["", " the", 'a "quoted" \\ back', "tab\there\nnew\r\x08\x0c", "\x01\x1f\x7f", "é ü 漢字 🙂", "\u2028\u2029",
         "</script>", "%s {} [] ,:"]  # fmt: skip


def _completion(text: str) -> bytes:
    return sse(CompletionStreamResponse(id="cmpl-1", created=7, model="m", choices=[CompletionStreamChoice(index=2,
               text=text)]))  # fmt: skip


def _chat(text: str) -> bytes:
    choice = ChatStreamChoice(index=0, delta=DeltaMessage(content=text))
    return sse(ChatCompletionStreamResponse(id="chatcmpl-1", created=7, model="m", choices=[choice]))


@pytest.mark.parametrize("make", [_completion, _chat], ids=["completion", "chat"])
def test_filled_template_equals_the_serialized_chunk(make) -> None:
    template = TextTemplate(make(TEXT_MARK))
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 0x250)] + ["🙂", "\u2028", '"', "\\"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for text in texts:
        assert template.fill(text) == make(text), repr(text)


def test_an_event_without_the_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="marker"):
        TextTemplate(_completion("plain"))
