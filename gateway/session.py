"""One rollout's OpenAI endpoint: its calls served by the rollout's engine, recorded as steps.

`AgentSession` owns everything a rollout's agent did through the gateway. Each call becomes a
`Step` holding the exact prompt ids the model saw, the completion ids, their sampler logprobs and
the policy version (`ModelOutput`); so training never re-tokenises text.

**Token fidelity.** The chat template is applied once, here. When a request carries a reply this
session returned (matched by its content and tool calls) after the same earlier messages, its
prompt is the earlier call's prompt and completion tokens, then the template's tokens for the new
messages: the conversation extends token for token, and `Trajectory.sequences` trains it as one
sequence. A request that rewrites history is templated afresh; it starts a new sequence.
`Step.info["extends_previous"]` records which.

**Tool calls.** With `tools` in the request, `<tool_call>{...}</tool_call>` blocks in the reply
(the Hermes/Qwen format, `workflows.tool_calls`) come back as OpenAI `tool_calls`, the text around
them as `content`; a malformed block stays in the content, as OpenAI-compatible servers do, and is
counted (`Step.info["tool_errors"]`). With `declare_tools` off the template does not declare the
tools (a model that learnt them, in a short context); their calls still parse.

**Sampling.** The rollout's settings (train or eval) are the trainer's: `temperature`, `top_p`
and `seed` a client sends are overridden (counted in `overridden`), since a rollout sampled at
another temperature or a fixed seed would train on the wrong distribution or give every rollout
of a group the same reply. `max_tokens` (at most the trainer's) and `stop` are the client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.api import (
    ChatRequest,
    CompletionRequest,
    GatewayError,
    completion,
)
from unified.errors import UsageError
from unified.protocol import RolloutEngine
from unified.types import ModelOutput, Step
from workflows.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls

__all__ = ["AgentSession"]

_T = TypeVar("_T")
_FINISH = {"stop": "stop", "length": "length", "aborted": "length"}


@dataclass(frozen=True)
class _Call:
    """A chat call as the next request may echo it: its messages, its tools and its reply."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: dict[str, Any]
    output: ModelOutput


class AgentSession:
    """The calls of one rollout's agent: served by `engine`, kept as `steps` in call order.

    The gateway routes `.../sessions/<id>/v1/...` here while the session is open; `close()`
    cancels calls still being served and turns later requests away.
    """

    def __init__(
        self,
        session_id: str,
        api_key: str,
        engine: RolloutEngine,
        model: str,
        *,
        declare_tools: bool = True,
    ) -> None:
        self.id = session_id
        self.declare_tools = declare_tools
        self.api_key = api_key
        self.model = model
        self.engine = engine
        self.steps: list[Step] = []
        self.overridden = 0
        """Requests whose temperature, top_p or seed were replaced by the trainer's."""
        self._calls: list[_Call] = []
        self._last: ModelOutput | None = None
        self._closed = False
        self._serving: set[asyncio.Task[Any]] = set()  # request tasks inside `_serve`
        self._cut: set[asyncio.Task[Any]] = set()  # those `close()` cancelled
        self._ids = itertools.count()

    def close(self) -> None:
        """Turn later requests away and cancel the calls still being served."""
        self._closed = True
        for task in self._serving - self._cut:
            task.cancel()
            self._cut.add(task)

    async def chat(self, request: ChatRequest) -> dict[str, Any]:
        """Serve one chat completion and record it as a step."""
        tools = request.tools or None
        declared = tools if self.declare_tools else None
        prompt_ids, spliced = self._prompt(request.messages, declared)
        limit = request.completion_limit()
        output = await self._serve(lambda: self._sample(prompt_ids, request, limit))
        parse = tools is not None and request.tool_choice != "none"
        message, calls, errors = self._reply(output.text) if parse else (_text(output.text), 0, 0)
        finish = "tool_calls" if message.get("tool_calls") else _FINISH[output.finish_reason]
        extends = self._extends(output)
        self.steps.append(
            Step(
                messages=request.messages,
                output=output,
                info={
                    "extends_previous": extends,
                    "spliced": spliced,
                    "tool_calls": calls,
                    "tool_errors": errors,
                },
            )
        )
        self._calls.append(_Call(request.messages, declared, message, output))
        self._last = output
        return completion(
            "chat.completion",
            f"chatcmpl-{self.id}-{len(self.steps)}",
            self.model,
            {"message": message},
            finish,
            len(output.prompt_ids),
            len(output.completion_ids),
        )

    async def complete(self, request: CompletionRequest) -> dict[str, Any]:
        """Serve one text completion (no chat template) and record it as a step."""
        prompt = request.prompt
        ids = (
            [int(t) for t in prompt]
            if isinstance(prompt, list)
            else self.engine.tokenizer.encode(prompt)
        )
        if not ids:
            raise GatewayError(400, "prompt: empty", param="prompt")
        output = await self._serve(lambda: self._sample(ids, request, request.max_tokens))
        extends = self._extends(output)
        self.steps.append(Step(output=output, info={"extends_previous": extends}))
        self._last = output
        return completion(
            "text_completion",
            f"cmpl-{self.id}-{len(self.steps)}",
            self.model,
            {"text": output.text},
            _FINISH[output.finish_reason],
            len(output.prompt_ids),
            len(output.completion_ids),
        )

    async def _serve(self, call: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Run `call` in the request's own task as a call of this session: `close()` cancels
        it there, and the client gets a 404 (a cancellation from elsewhere propagates)."""
        task = asyncio.current_task()
        if self._closed or task is None:
            raise _closed_error(self.id)
        self._serving.add(task)
        try:
            return await call()
        except asyncio.CancelledError:
            if task in self._cut and task.uncancel() == 0:
                raise _closed_error(self.id) from None
            raise
        finally:
            self._serving.discard(task)
            self._cut.discard(task)

    async def _sample(
        self, prompt_ids: list[int], request: ChatRequest | CompletionRequest, limit: int | None
    ) -> ModelOutput:
        defaults = self.engine.sampling_defaults
        sampling: dict[str, Any] = {}
        if limit is not None:
            sampling["max_tokens"] = min(limit, defaults.max_tokens)
        if request.stop is not None:
            sampling["stop"] = [*defaults.stop, *request.stop_strings()]
        if (
            (request.temperature is not None and request.temperature != defaults.temperature)
            or (request.top_p is not None and request.top_p != defaults.top_p)
            or request.seed is not None
        ):
            self.overridden += 1
        try:
            return await self.engine.complete(prompt_ids, **sampling)
        except UsageError as e:  # the engine refuses the request itself: too long, say
            raise GatewayError(400, str(e), param="messages") from None

    def _prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], bool]:
        """The prompt ids of `messages`, and whether an earlier call's tokens were spliced in."""
        full = self.engine.encode_chat(messages, tools=tools)
        for call in reversed(self._calls):
            n = len(call.messages)
            if (
                len(messages) > n
                and call.tools == tools
                and _same_message(messages[n], call.reply)
                and all(map(_same_message, messages[:n], call.messages))
            ):
                head = self.engine.encode_chat(
                    messages[: n + 1], add_generation_prompt=False, tools=tools
                )
                if full[: len(head)] == head:
                    out = call.output
                    return [*out.prompt_ids, *out.completion_ids, *full[len(head) :]], True
                break
        return full, False

    def _extends(self, output: ModelOutput) -> bool:
        """Whether `output`'s prompt extends the previous call's prompt and completion."""
        last = self._last
        if last is None:
            return False
        before = [*last.prompt_ids, *last.completion_ids]
        return output.prompt_ids[: len(before)] == before and len(output.prompt_ids) > len(before)

    def _reply(self, text: str) -> tuple[dict[str, Any], int, int]:
        """The assistant message for `text` with its tool calls, the calls and malformed ones."""
        parsed = parse_tool_calls(text)
        errors = sum(call.error is not None for call in parsed)
        if not parsed or errors:
            return _text(text), len(parsed), errors
        content = _without_calls(text).strip()
        tool_calls = [
            {
                "id": f"call_{self.id}_{next(self._ids)}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in parsed
        ]
        return (
            {"role": "assistant", "content": content or None, "tool_calls": tool_calls},
            len(parsed),
            0,
        )


def _closed_error(session_id: str) -> GatewayError:
    return GatewayError(404, f"session {session_id} is closed: its rollout has ended")


def _text(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _without_calls(text: str) -> str:
    """`text` with its `<tool_call>...</tool_call>` blocks cut out."""
    pieces: list[str] = []
    position = 0
    while (start := text.find(TOOL_CALL_START, position)) >= 0:
        pieces.append(text[position:start])
        position = text.find(TOOL_CALL_END, start) + len(TOOL_CALL_END)
    pieces.append(text[position:])
    return "".join(pieces)


def _same_message(sent: dict[str, Any], known: dict[str, Any]) -> bool:
    """Whether a message a client sent is `known` (a request's message or a reply), comparing
    what a client may re-serialise differently: empty content, arguments' JSON spacing."""
    if sent.get("role") != known.get("role") or (sent.get("content") or "") != (
        known.get("content") or ""
    ):
        return False
    if sent.get("tool_call_id") != known.get("tool_call_id"):
        return False
    return _calls_of(sent) == _calls_of(known)


def _calls_of(message: dict[str, Any]) -> list[tuple[Any, ...]]:
    calls: Sequence[Any] = message.get("tool_calls") or []
    out = []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        out.append((call.get("id"), function.get("name"), json.dumps(arguments, sort_keys=True)))
    return out
