"""The OpenAI API's request and response shapes, as vLLM serves them, and the error object.

Requests are checked field by field here, so a handler only ever sees valid values: a wrong field is an
`APIError` (HTTP 400 with `{"error": {"message", "type", "param", "code"}}`, one sentence naming the
field). Fields this server does not know are ignored, as vLLM and OpenAI do; fields it knows but cannot
honour (`n > 1`, `best_of > 1`, `suffix`, top-n `logprobs` beyond the sampled token) are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from afd.engine.sampling import SamplingParams

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """A request the server answers with an error object; `headers` go on the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ---------------------------------------------------------------- field readers
def _is_int(x: object) -> bool:
    # `type(x) is int` first: JSON's integers are exactly int, and the ABC check costs ~1 µs a token
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def _is_number(x: object) -> bool:
    if type(x) is float or type(x) is int:  # JSON's numbers, without the ABC check
        return math.isfinite(x)
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _int(body: dict, name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < minimum:
        raise bad(name, f"{name} must be an integer of at least {minimum}, got {value!r}")
    return int(value)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad(name, f"{name} must be a finite number, got {value!r}")
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {value!r}")
    return value


def _token_ids(value: object, name: str) -> list[int] | None:
    """A list of non-negative integers, or None when `value` is not a list of integers at all."""
    if not isinstance(value, list) or not value:
        return None
    exact = set(map(type, value)) == {int}  # JSON's integers: one pass in C, not a Python step per token
    if not exact and not all(_is_int(t) for t in value):
        return None
    if min(value) < 0:
        raise bad(name, f"{name} holds the negative token id {min(value)}")
    return value if exact else [int(t) for t in value]


# ---------------------------------------------------------------- requests
@dataclass
class GenerationParams:
    """What every generation request carries, checked (`max_tokens` None: as much as the model length allows)."""

    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0 or 1: the sampled token's logprob (top-n beyond it is refused)
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    afd_timing: bool = False  # afd's own: the closing chunk carries `afd_timing` (what `afd bench serve` reads)


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: GenerationParams


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]  # {"role": str, "content": str}
    params: GenerationParams


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"model must be a string, got {model!r}")
    return model


def _params(body: dict, *, default_max_tokens: int | None, logprobs: int | None) -> GenerationParams:
    if _int(body, "n", 1, 1) != 1:
        raise bad("n", "n must be 1: this server returns one choice per prompt")
    if _int(body, "best_of", 1, 1) != 1:
        raise bad("best_of", "best_of must be 1: this server returns one choice per prompt")
    top_k = _int(body, "top_k", 0, -1)
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0),  # the API's default: sampling
            top_p=_number(body, "top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM's -1 (off) is 0 here
            seed=_int(body, "seed", None, 0),
        )
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise bad(param, str(exc)) from None
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    stop_ids = body.get("stop_token_ids") or []
    if stop_ids and _token_ids(stop_ids, "stop_token_ids") is None:
        raise bad("stop_token_ids", "stop_token_ids must be a list of integer token ids")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", 'stream_options must be an object such as {"include_usage": true}')
    stream = _bool(body, "stream")
    if options is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    return GenerationParams(
        max_tokens=_int(body, "max_tokens", default_max_tokens, 1),
        sampling=sampling,
        stop=list(stop),
        stop_token_ids=list(stop_ids),
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=logprobs,
        echo=_bool(body, "echo"),
        stream=stream,
        include_usage=_bool(options or {}, "include_usage"),
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids"),
        afd_timing=_bool(body, "afd_timing"),
    )


def _top_n(body: dict, name: str) -> int | None:
    n = _int(body, name, None, 0)
    if n is not None and n > 1:
        raise bad(name, f"{name} must be 0 or 1: only the sampled token's logprob is available, got {n}")
    return n


def parse_completion(body: dict) -> CompletionRequest:
    """`/v1/completions`: `prompt` is a string, a list of token ids, or a list of either (one choice each)."""
    if body.get("suffix") is not None:
        raise bad("suffix", "suffix is not supported")
    prompt = body.get("prompt")
    ids = None if isinstance(prompt, str) else _token_ids(prompt, "prompt")
    if isinstance(prompt, str) or ids is not None:
        prompts = [prompt if ids is None else ids]
    elif isinstance(prompt, list) and prompt:
        prompts = []
        for item in prompt:
            ids = _token_ids(item, "prompt")
            if not isinstance(item, str) and ids is None:
                raise bad("prompt", "prompt must be a string, a list of token ids, or a list of either")
            prompts.append(item if isinstance(item, str) else ids)
    else:
        raise bad("prompt", "prompt must be a non-empty string, a list of token ids, or a list of either")
    params = _params(body, default_max_tokens=DEFAULT_COMPLETION_TOKENS, logprobs=_top_n(body, "logprobs"))
    return CompletionRequest(_model(body), prompts, params)


def parse_chat(body: dict) -> ChatRequest:
    """`/v1/chat/completions`: `messages` of `{"role", "content"}`; content as a string or text parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", 'messages must be a non-empty list of {"role", "content"} objects')
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("messages", f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # text parts: [{"type": "text", "text": ...}]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad("messages", f"messages[{i}].content may hold only text parts")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")
        clean.append({"role": m["role"], "content": content})
    wants = _bool(body, "logprobs")
    top = _top_n(body, "top_logprobs")
    if top is not None and not wants:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = _params(
        {**body, "max_tokens": max_tokens}, default_max_tokens=None, logprobs=(top or 0) if wants else None
    )
    if params.echo:
        raise bad("echo", "echo is not supported for chat completions")
    return ChatRequest(_model(body), clean, params)


# ---------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(tokens: list[str], logprobs: list[float | None], offsets: list[int], top: bool) -> dict:
    """`choices[i].logprobs` of /v1/completions; `top_logprobs` holds the sampled token only."""
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [None if lp is None else {t: lp} for t, lp in zip(tokens, logprobs, strict=True)]
        if top
        else None,
        "text_offset": offsets,
    }


def chat_logprobs(tokens: list[str], logprobs: list[float], top: bool) -> dict:
    """`choices[i].logprobs` of /v1/chat/completions; `top_logprobs` holds the sampled token only."""
    content = []
    for t, lp in zip(tokens, logprobs, strict=True):
        entry = {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        entry["top_logprobs"] = [dict(entry)] if top else []
        content.append(entry)
    return {"content": content}
