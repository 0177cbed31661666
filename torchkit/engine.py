"""The local sampling engine: the chat template over a batching sampler (local and verl backends).

`LocalEngine` is the `RolloutEngine` of a backend that samples in-process: it renders messages
with the tokenizer's chat template and sends the prompt's token ids to the backend's
`BatchingSampler`, which samples on whatever weights the backend last synced into it.
"""

from __future__ import annotations

from typing import Any, Protocol

from torchkit.builtin import chat_prompt_ids
from torchkit.sampler import BatchingSampler
from unified.protocol import RolloutEngine, Tokenizer
from unified.types import ModelOutput, SamplingParams

__all__ = ["LocalEngine", "SamplerHost"]


class SamplerHost(Protocol):
    """What `LocalEngine` samples through: a tokenizer and a `BatchingSampler` (local, verl)."""

    tokenizer: Any
    sampler: BatchingSampler


class LocalEngine(RolloutEngine):
    """Chat template + the batching sampler."""

    def __init__(self, backend: SamplerHost) -> None:
        self._backend = backend

    @property
    def tokenizer(self) -> Tokenizer:
        return self._backend.tokenizer  # type: ignore[no-any-return]

    def encode_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return chat_prompt_ids(
            self._backend.tokenizer, messages, add_generation_prompt=add_generation_prompt
        )

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ModelOutput:
        return await self.complete(self.encode_chat(messages), **sampling)

    async def complete(self, prompt_ids: list[int], **sampling: Any) -> ModelOutput:
        return await self._backend.sampler.generate(
            prompt_ids, SamplingParams.model_validate(sampling)
        )
