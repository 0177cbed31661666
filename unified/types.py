"""Data that flows through the trainer: tasks in, model outputs, trajectories, episodes, groups out.

A workflow turns a `Task` into a `Trajectory` of `Step`s, each holding the `ModelOutput` of one
model call; the trainer wraps each run in an `Episode`, and the `group_size` episodes of one task
form a `TrajectoryGroup`, the unit that is filtered, given advantages, and trained.
"""

from __future__ import annotations

import copy
import itertools
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import core_schema

__all__ = [
    "Episode",
    "EpisodeStatus",
    "EpisodeTiming",
    "FinishReason",
    "ModelOutput",
    "SamplingParams",
    "Step",
    "Task",
    "Trajectory",
    "TrajectoryGroup",
    "Transcript",
]

FinishReason = Literal["stop", "length", "aborted"]
EpisodeStatus = Literal["ok", "error", "timeout", "aborted"]
Message = dict[str, Any]


class Transcript(Sequence[Message]):
    """An append-only conversation whose snapshots share its storage instead of copying it.

    A multi-turn workflow appends each message once (copied then) and gives every `Step` the
    transcript itself: the step keeps an O(1) `snapshot()` of the first `len` messages, so an
    N-turn episode holds N messages, not N^2/2 copies. Nothing is ever removed or replaced, so a
    snapshot never changes; snapshots are frozen (appending to one raises). Entries are shared:
    read them, never mutate them in place.
    """

    __slots__ = ("_entries", "_frozen", "_length")

    def __init__(self, messages: Iterable[Mapping[str, Any]] = ()) -> None:
        self._entries: list[Message] = [dict(m) for m in messages]
        self._length = len(self._entries)
        self._frozen = False

    def append(self, message: Mapping[str, Any]) -> None:
        """Add one message (a shallow copy of it) at the end."""
        if self._frozen:
            raise TypeError("a Transcript snapshot is read-only; append to the live transcript")
        self._entries.append(dict(message))
        self._length += 1

    def extend(self, messages: Iterable[Mapping[str, Any]]) -> None:
        """Append each of `messages`."""
        for message in messages:
            self.append(message)

    def snapshot(self) -> Transcript:
        """A frozen view of the messages so far, sharing storage: O(1), unaffected by appends."""
        if self._frozen:
            return self
        view = Transcript.__new__(Transcript)
        view._entries, view._length, view._frozen = self._entries, self._length, True
        return view

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        if isinstance(index, slice):
            return self._entries[: self._length][index]
        if not -self._length <= index < self._length:
            raise IndexError(f"transcript index {index} out of range for {self._length} messages")
        return self._entries[index % self._length]

    def __iter__(self) -> Iterator[Message]:
        return itertools.islice(self._entries, self._length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Transcript, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return f"Transcript({list(self)!r})"

    def __deepcopy__(self, memo: dict[int, Any]) -> Transcript:
        # Copy only this view's messages, not the shared storage past it.
        return Transcript(copy.deepcopy(list(self), memo)).snapshot()

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.is_instance_schema(
            cls,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda t: [dict(m) for m in t]
            ),
        )


MAX_ABS_REWARD = 1e6
"""Rewards beyond this are a bug (a missing scale or a sentinel), and would swamp the advantages."""


def _checked_reward(reward: Any) -> float:
    """A reward as a float: a finite real number of at most `MAX_ABS_REWARD` in size."""
    if isinstance(reward, bool) or not isinstance(reward, int | float | numbers.Real):
        raise ValueError(f"reward must be a number, got {type(reward).__name__}")
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"reward must be a finite number, got {value}")
    if abs(value) > MAX_ABS_REWARD:
        raise ValueError(f"reward must be within +-{MAX_ABS_REWARD:g}, got {value:g}; scale it")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=False)


class Task(_Model):
    """One prompt or problem from the dataset; `data` is free-form and read by the workflow."""

    id: str
    data: dict[str, Any] = Field(default_factory=dict)


class SamplingParams(_Model):
    """Settings of one sampling request; the trainer picks train or eval settings per request."""

    temperature: float = Field(1.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(64, ge=1, description="Most completion tokens to generate.")
    stop: list[str] = Field(default_factory=list, description="Strings that end the completion.")
    seed: int | None = Field(
        None, description="Per-request sampling seed (if the backend has seeds)."
    )


class ModelOutput(_Model):
    """What one `chat`/`complete` call returned: text, tokens, per-token logprobs, version."""

    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int = Field(ge=0)
    token_versions: list[int] | None = None
    temperature: float | None = Field(
        None, description="Sampling temperature the logprobs are under, if the backend says."
    )
    token_times: tuple[float, float] | None = Field(
        None,
        description="Wall-clock times (`time.time()`) of this call's first and last sampled "
        "token, if the sampler reports them (the built-in one and vLLM do): the rollout records' "
        "timeline tells queueing and prefill from decoding with them.",
    )

    # Field validators, not a model validator: pydantic re-runs a model's after-validators each
    # time an instance is nested into another model (every Step), field validators only once.
    @field_validator("logprobs")
    @classmethod
    def _one_logprob_per_token(cls, logprobs: list[float], info: ValidationInfo) -> list[float]:
        n = len(info.data.get("completion_ids", ()))
        if len(logprobs) != n:
            raise ValueError(f"logprobs has {len(logprobs)} entries for {n} completion tokens")
        # sum() propagates NaN and inf: one C-level pass instead of a check per token.
        if logprobs and (not math.isfinite(sum(logprobs)) or max(logprobs) > 1e-6):
            raise ValueError("logprobs must be finite log-probabilities (<= 0)")
        return logprobs

    @field_validator("token_versions")
    @classmethod
    def _one_version_per_token(
        cls, versions: list[int] | None, info: ValidationInfo
    ) -> list[int] | None:
        n = len(info.data.get("completion_ids", ()))
        if versions is not None and len(versions) != n:
            raise ValueError(
                f"token_versions has {len(versions)} entries for {n} completion tokens"
            )
        return versions

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any completion token was sampled from."""
        if self.token_versions:
            return min(self.policy_version, *self.token_versions)
        return self.policy_version


class Step(_Model):
    """One model call: the conversation the model saw, what it returned, and the step's reward.

    `messages` given as a list is copied; given as a `Transcript`, the step keeps an O(1)
    snapshot of it. Either way, a workflow that keeps appending to one conversation never
    rewrites an earlier step.
    """

    # Left to right: a Transcript is taken by an isinstance check; smart mode would also try
    # the list branch on it, copying every message per step (quadratic in turns).
    messages: Transcript | list[Message] = Field(default_factory=list, union_mode="left_to_right")
    output: ModelOutput
    reward: float = 0.0
    info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward", mode="before")
    @classmethod
    def _valid_reward(cls, reward: Any) -> float:
        return _checked_reward(reward)

    @field_validator("messages", mode="before")
    @classmethod
    def _copy_messages(cls, messages: Any) -> Any:
        # A workflow that keeps appending to one list must not rewrite earlier steps.
        if isinstance(messages, Transcript):
            return messages.snapshot()
        if isinstance(messages, list):
            return [dict(m) if isinstance(m, dict) else m for m in messages]
        return messages


class Trajectory(_Model):
    """The steps of one agent in one rollout, and its scalar reward."""

    steps: list[Step]
    reward: float
    name: str = "default"

    @field_validator("reward", mode="before")
    @classmethod
    def _valid_reward(cls, reward: Any) -> float:
        return _checked_reward(reward)

    def sequences(self) -> list[list[ModelOutput]]:
        """The model calls to train on, as runs that each train as one token sequence.

        A call (a step with completion tokens) joins the run before it while its prompt extends
        that run's last prompt and completion, as a multi-turn chat's does: the run's last call
        then holds every token, and the earlier calls' completions are spans of it. A call whose
        prompt rewrites earlier tokens starts a new run. Every backend trains on these runs.
        """
        runs: list[list[ModelOutput]] = []
        for out in (step.output for step in self.steps if step.output.completion_ids):
            if runs:
                last = runs[-1][-1]
                n = len(last.prompt_ids)
                m = n + len(last.completion_ids)
                if (
                    len(out.prompt_ids) >= m
                    and out.prompt_ids[:n] == last.prompt_ids
                    and out.prompt_ids[n:m] == last.completion_ids
                ):
                    runs[-1].append(out)
                    continue
            runs.append([out])
        return runs


CallTimes = tuple[float, float] | tuple[float, float, float, float]
"""One model call's wall-clock (request, reply), or (request, first token, last token, reply)."""


class EpisodeTiming(_Model):
    """When one rollout ran, in wall-clock seconds (`time.time()`), as its runner saw it: the
    workflow's start and end, and each model call's (request, reply), or (request, first token,
    last token, reply) where the sampler reports its token times. The rollout records' timeline
    draws it; nothing trains on it."""

    started: float
    ended: float
    calls: list[CallTimes] = Field(default_factory=list)


class Episode(_Model):
    """One workflow run on one task, as the trainer recorded it."""

    task_id: str
    rollout_index: int
    trajectories: list[Trajectory] = Field(default_factory=list)
    status: EpisodeStatus = "ok"
    error: str | None = None
    policy_version: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)
    timing: EpisodeTiming | None = None

    @property
    def reward(self) -> float:
        """The episode's reward: the sum of its trajectories' rewards."""
        return sum(t.reward for t in self.trajectories)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any token of this episode came from."""
        versions = [s.output.oldest_version for t in self.trajectories for s in t.steps]
        return min([self.policy_version, *versions])

    @property
    def completion_tokens(self) -> int:
        """Tokens the policy sampled in this episode: every model call's completion."""
        return sum(len(s.output.completion_ids) for t in self.trajectories for s in t.steps)


class TrajectoryGroup(_Model):
    """The rollouts of one task: the unit that is filtered, advantaged and trained. All
    `group_size` of them, or the `trainer.keep_per_group` whose rewards spread the most.

    `advantages` has one entry per episode; `policy_version` is the oldest version any token of
    the group came from (or the version it was dispatched at, if older).
    """

    task_id: str
    episodes: list[Episode]
    advantages: list[float]
    policy_version: int
    group_id: str = ""

    @model_validator(mode="after")
    def _one_advantage_per_episode(self) -> TrajectoryGroup:
        if len(self.advantages) != len(self.episodes):
            raise ValueError(f"{len(self.advantages)} advantages for {len(self.episodes)} episodes")
        return self
