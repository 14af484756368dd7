"""OpenAI request and response shapes (completions, chat completions, models, errors).

Unknown request fields are ignored, as OpenAI-compatible servers do; fields we cannot honour (``n`` > 1,
``logprobs``, ``echo``, penalties) are refused with a 400 that names them rather than silently ignored.
Extensions: ``domain`` (which drafter), ``top_k``, ``ignore_eos``, ``return_token_ids``. Responses carry a
``dspark`` object (domain, drafter, rounds, drafted and accepted tokens) next to the standard fields.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dspark_core.data.limits import MAX_NEW_TOKENS_MAX, SEED_MAX, SEED_MIN, TEMPERATURE_MAX, TOP_K_MAX


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def check_text(value: str | None, param: str) -> None:
    """A 400 for a string that is not valid Unicode text (a lone surrogate such as ``\\ud800``, which
    JSON can carry but UTF-8 cannot encode): nothing downstream could tokenize, log or store it."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode text: a lone surrogate {value[e.start]!r} at "
                       f"character {e.start}", param=param) from None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=TEMPERATURE_MAX)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=TOP_K_MAX)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | bool | None = None
    user: str | None = None
    domain: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False          # extension: the completion's token ids in the ``dspark`` object

    def check_supported(self) -> None:
        for name in ("model", "domain", "user"):
            check_text(getattr(self, name), name)
        for stop in [self.stop] if isinstance(self.stop, str) else list(self.stop or []):
            check_text(stop, "stop")
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported: send one request per completion", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        for name, value in (("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty)):
            if value:
                raise APIError(400, f"{name} is not supported (it would change the target's distribution)",
                               param=name)

    def stop_list(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, "at most 4 stop sequences are allowed", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop sequences must be non-empty strings", param="stop")
        return tuple(stops)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1, le=MAX_NEW_TOKENS_MAX)
    echo: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        for p in [self.prompt] if isinstance(self.prompt, str) else self.prompt:
            if isinstance(p, str):
                check_text(p, "prompt")

    def prompt_input(self) -> str | list[int]:
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        p = self.prompt
        if isinstance(p, list):
            if not p:
                raise APIError(400, "prompt is empty", param="prompt")
            if all(isinstance(x, str) for x in p):
                if len(p) != 1:
                    raise APIError(400, "a list of several prompts is not supported: send one request per prompt",
                                   param="prompt")
                p = p[0]
            else:
                return list(p)
        if not p.strip():
            raise APIError(400, "prompt is empty: give some text", param="prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_MAX)

    def check_supported(self) -> None:
        super().check_supported()
        for i, m in enumerate(self.messages):
            check_text(m.text(), f"messages[{i}].content")


def now() -> int:
    return int(time.time())


def completion_body(rid: str, model: str, created: int, text: str, finish: str | None, usage: dict | None,
                    info: dict | None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    if info is not None:
        out["dspark"] = info
    return out


def chat_body(rid: str, model: str, created: int, text: str, finish: str | None, usage: dict | None,
              info: dict | None) -> dict:
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
           "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    if info is not None:
        out["dspark"] = info
    return out


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop / length; a cancelled request never reaches a client."""
    return "length" if reason == "length" else ("stop" if reason is not None else None)
