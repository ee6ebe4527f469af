"""The OpenAI API's request and response bodies, as vLLM serves them, as pydantic models; and the error object.

One request model per route (`CompletionRequest`, `ChatCompletionRequest`): FastAPI validates a body against it
and the OpenAPI schema (`/openapi.json`, `/docs`) comes from it. Types are strict (`"5"` is not a number, `"yes"`
not a boolean); fields this server does not know are ignored, as vLLM and OpenAI do; fields it knows but cannot
honour (`n > 1`, `best_of > 1`, `suffix`, top-n `logprobs` beyond the sampled token) are refused. A refusal is an
`APIError`: HTTP 400 with `{"error": {"message", "type", "param", "code"}}`, one sentence naming the field
(`validation_error` turns pydantic's errors into it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator
from pydantic import StrictFloat as _StrictFloat
from pydantic_core import PydanticCustomError

from afd.engine.sampling import SamplingParams

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
DONE = b"data: [DONE]\n\n"
OURS = "afd"  # the error type of our own checks: their message is the whole sentence


class APIError(Exception):
    """A request the server answers with an error object; `headers` go on the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


def refuse(message: str) -> PydanticCustomError:
    """A validator's refusal whose message is the client's whole sentence."""
    return PydanticCustomError(OURS, message)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's (or FastAPI's) validation errors as one 400: the first error, its field named."""
    if not errors:
        return bad(None, "the request body is not valid")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad(None, "the request body is not valid JSON")
    if not loc or not isinstance(loc[0], str):
        return bad(None, "the request body must be a JSON object")
    param = loc[0]
    where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    if first.get("type") == OURS:  # a sentence of ours: whole at the top level, a predicate deeper down
        return bad(param, first["msg"] if len(loc) == 1 else f"{where} {first['msg']}")
    message = first.get("msg", "is not valid").rstrip(".")
    return bad(param, f"{where}: {message[:1].lower()}{message[1:]}")


def sse(obj: dict | BaseModel) -> bytes:
    """One server-sent event carrying a JSON object."""
    if isinstance(obj, BaseModel):
        return b"data: " + obj.model_dump_json().encode() + b"\n\n"
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ---------------------------------------------------------------- requests
Finite = Annotated[_StrictFloat, Field(allow_inf_nan=False)]  # JSON numbers, integers included; no NaN
TokenId = Annotated[StrictInt, Field(ge=0)]
Flag = StrictBool | None  # null reads as the default, as vLLM takes it


class StreamOptions(BaseModel):
    include_usage: Flag = False


class SamplingFields(BaseModel):
    """The fields both generation routes share (OpenAI's and vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Annotated[StrictInt, Field(ge=0)] | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: Flag = False
    stream: Flag = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: Flag = False
    afd_timing: Flag = Field(False, description="afd's own: the closing chunk of a stream carries `afd_timing`")

    @field_validator("n", "best_of")
    @classmethod
    def _one_choice(cls, value: int | None, info) -> int | None:
        if value is not None and value != 1:
            raise refuse(f"{info.field_name} must be 1: this server returns one choice per prompt")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        strings = [value] if isinstance(value, str) else value
        if value is None:
            return None
        if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
            raise refuse("stop must be a non-empty string or a list of non-empty strings")
        if len(strings) > MAX_STOP_STRINGS:
            raise refuse(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
        return value

    def params(self, *, default_max_tokens: int | None, logprobs: int | None, echo: bool = False) -> GenerationParams:
        """The checked `GenerationParams` (APIError when the sampling values do not go together)."""
        if self.stream_options is not None and not self.stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        top_k = 0 if self.top_k in (None, -1) else self.top_k  # vLLM's -1 (off) is 0 here
        try:
            sampling = SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,  # the API's default: sampling
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=top_k,
                seed=self.seed,
            )
        except ValueError as exc:
            raise bad(str(exc).split(" ", 1)[0], str(exc)) from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            sampling=sampling,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            echo=echo,
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            return_tokens_as_token_ids=bool(self.return_tokens_as_token_ids),
            afd_timing=bool(self.afd_timing),
        )


def _top_n(value: int | None, name: str) -> int | None:
    if value is not None and value > 1:
        raise refuse(f"{name} must be 0 or 1: only the sampled token's logprob is available, got {value}")
    return value


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: `prompt` is a string, a list of token ids, or a list of either (one choice each)."""

    prompt: StrictStr | list[TokenId] | list[StrictStr | list[TokenId]]
    echo: Flag = False
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        shape = "prompt must be a non-empty string, a list of token ids, or a list of either"
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise refuse(shape)
        if set(map(type, value)) == {int}:  # token ids, checked in one pass in C
            if min(value) < 0:
                raise refuse(f"prompt holds the negative token id {min(value)}")
            return value
        for item in value:
            if isinstance(item, str):
                continue
            if not isinstance(item, list) or not item or set(map(type, item)) != {int}:
                raise refuse(shape)
            if min(item) < 0:
                raise refuse(f"prompt holds the negative token id {min(item)}")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        return _top_n(value, "logprobs")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: Any) -> Any:
        if value is not None:
            raise refuse("suffix is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def generation(self) -> GenerationParams:
        return self.params(default_max_tokens=DEFAULT_COMPLETION_TOKENS, logprobs=self.logprobs, echo=bool(self.echo))


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
            ):
                raise refuse("may hold only text parts")
            return value
        raise refuse("must be a string or a list of text parts")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`: `messages` of `{"role", "content"}`; content as a string or text parts."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: Flag = False
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: Flag = False

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise refuse('messages must be a non-empty list of {"role", "content"} objects')
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise refuse(f"messages[{i}] must be an object with a string role")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        return _top_n(value, "top_logprobs")

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool | None) -> bool | None:
        if value:
            raise refuse("echo is not supported for chat completions")
        return value

    def chat(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def generation(self) -> GenerationParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self.params(default_max_tokens=None, logprobs=(self.top_logprobs or 0) if self.logprobs else None)


def parse_completion(body: object) -> CompletionRequest:
    """A decoded JSON body as a `CompletionRequest` (APIError 400 otherwise); FastAPI does this for the routes."""
    return _parse(CompletionRequest, body)


def parse_chat(body: object) -> ChatCompletionRequest:
    return _parse(ChatCompletionRequest, body)


def _parse(model: type[SamplingFields], body: object):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False, include_input=False)) from None


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


# ---------------------------------------------------------------- responses
def _omit_none(value: object) -> bool:
    return value is None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogProbs(BaseModel):
    """`top_logprobs` holds the sampled token only (the replicas report no others)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]

    @classmethod
    def of(cls, tokens: list[str], logprobs: list[float | None], offsets: list[int], top: bool) -> CompletionLogProbs:
        tops = [None if lp is None else {t: lp} for t, lp in zip(tokens, logprobs, strict=True)] if top else None
        return cls(tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class AfdTiming(BaseModel):
    """afd's own (asked with `afd_timing: true`): a choice's replica time to its first token, and the moments on
    the way there (`time.perf_counter()` of the server's host)."""

    index: int
    engine_ttft_s: float | None
    stamps: dict[str, float] | None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = Field(None, exclude_if=_omit_none)
    afd_timing: AfdTiming | None = Field(None, exclude_if=_omit_none)


class ChatTopLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogProb(ChatTopLogProb):
    top_logprobs: list[ChatTopLogProb]


class ChatLogProbs(BaseModel):
    content: list[ChatLogProb]

    @classmethod
    def of(cls, tokens: list[str], logprobs: list[float], top: bool) -> ChatLogProbs:
        content = []
        for t, lp in zip(tokens, logprobs, strict=True):
            raw = list(t.encode("utf-8"))
            tops = [ChatTopLogProb(token=t, logprob=lp, bytes=raw)] if top else []
            content.append(ChatLogProb(token=t, logprob=lp, bytes=raw, top_logprobs=tops))
        return cls(content=content)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = Field(None, exclude_if=_omit_none)
    afd_timing: AfdTiming | None = Field(None, exclude_if=_omit_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "afd"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
