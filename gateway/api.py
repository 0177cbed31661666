"""The OpenAI wire format the gateway speaks: requests it accepts, answers and errors it sends.

Requests are validated here, at the boundary: what the gateway cannot honour (`n > 1`, logprobs,
penalties, JSON mode, a forced tool choice, image parts) is refused with OpenAI's error JSON and
a 400 naming the parameter, never half-applied. Unknown extra keys (clients add their own) are
ignored. Answers are plain dicts shaped like the `openai` client's `ChatCompletion`,
`ChatCompletionChunk` and `Completion`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "GatewayError",
    "chat_chunks",
    "completion",
    "error_body",
    "first_error",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]


class GatewayError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def error_body(error: GatewayError) -> dict[str, Any]:
    """OpenAI's error JSON: what the `openai` client turns into `BadRequestError` and friends."""
    return {
        "error": {
            "message": error.message,
            "type": error.kind,
            "param": error.param,
            "code": None,
        }
    }


def first_error(error: ValidationError) -> GatewayError:
    """A 400 naming the first field a request got wrong."""
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if param is None:  # a whole-request check names its parameter first: "n: ..."
        param = message.split(":", 1)[0] if ":" in message else None
        return GatewayError(400, message, param=param)
    return GatewayError(400, f"{param}: {message}", param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _honourable(self) -> _Request:
        if self.n != 1:
            raise ValueError("n: one choice per request (n=1); send n requests instead")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}: penalties are not applied by the trained sampler")
        if self.logit_bias:
            raise ValueError("logit_bias: not applied by the trained sampler")
        return self

    def stop_strings(self) -> list[str]:
        """The request's stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Request):
    """`POST /v1/chat/completions`."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_honourable(self) -> ChatRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs: not returned (the trainer records them itself)")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format: only text; JSON mode is not enforced")
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError("tool_choice: 'auto' or 'none'; the sampler cannot force a tool call")
        for index, message in enumerate(self.messages):
            self.messages[index] = _plain_message(message, index)
        for tool in self.tools or []:
            if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
                raise ValueError('tools: each tool is {"type": "function", "function": {...}}')
        return self

    def completion_limit(self) -> int | None:
        """`max_completion_tokens`, else the older `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    """`POST /v1/completions`: a text prompt, or one prompt of token ids."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None

    @model_validator(mode="after")
    def _completion_honourable(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request")
            self.prompt = self.prompt[0]
        if self.echo or self.logprobs:
            raise ValueError("echo and logprobs are not returned")
        return self


def _plain_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message with text content: a list of text parts is joined; anything else is refused."""
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ValueError(f"messages[{index}].role: {role!r} is not a chat role")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{index}].content: {kind} parts are not served")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{index}].content: text or a list of text parts")
    plain = {k: v for k, v in message.items() if v is not None}
    plain["content"] = content or ""
    if role == "developer":  # OpenAI's newer name for the system message
        plain["role"] = "system"
    return plain


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    kind: Literal["chat.completion", "text_completion"],
    call_id: str,
    model: str,
    answer: dict[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A `chat.completion` (`answer`: `{"message": ...}`) or `text_completion` (`{"text": ...}`)
    object with one choice."""
    return {
        "id": call_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, **answer, "finish_reason": finish_reason, "logprobs": None}],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def chat_chunks(completion: dict[str, Any], *, include_usage: bool) -> list[str]:
    """`completion` as server-sent events of `chat.completion.chunk`s, then `[DONE]`.

    The completion is whole when the stream starts (the engine returns a reply at once): one
    chunk with the role and content, one per tool call, one with the finish reason.
    """
    choice = completion["choices"][0]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": message["content"] or ""}]
    for index, call in enumerate(message.get("tool_calls") or []):
        deltas.append({"tool_calls": [{"index": index, **call}]})
    chunks = [
        {**head, "object": "chat.completion.chunk", "choices": [_delta(d, None)]} for d in deltas
    ]
    last: dict[str, Any] = {
        **head,
        "object": "chat.completion.chunk",
        "choices": [_delta({}, choice["finish_reason"])],
    }
    chunks.append(last)
    if include_usage:
        chunks.append(
            {**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]}
        )
    return [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]


def _delta(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
