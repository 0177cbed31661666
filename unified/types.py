"""Data that flows through the trainer: tasks in, model outputs, trajectories, episodes, groups out.

A workflow turns a `Task` into a `Trajectory` of `Step`s, each holding the `ModelOutput` of one
model call; the trainer wraps each run in an `Episode`, and the `group_size` episodes of one task
form a `TrajectoryGroup`, the unit that is filtered, given advantages, and trained.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "Episode",
    "EpisodeStatus",
    "FinishReason",
    "ModelOutput",
    "SamplingParams",
    "Step",
    "Task",
    "Trajectory",
    "TrajectoryGroup",
]

FinishReason = Literal["stop", "length", "aborted"]
EpisodeStatus = Literal["ok", "error", "timeout", "aborted"]
Message = dict[str, Any]


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
    """One model call: the conversation the model saw, what it returned, and the step's reward."""

    messages: list[Message] = Field(default_factory=list)
    output: ModelOutput
    reward: float = 0.0
    info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("messages", mode="before")
    @classmethod
    def _copy_messages(cls, messages: Any) -> Any:
        # A workflow that keeps appending to one list must not rewrite earlier steps.
        if isinstance(messages, list):
            return [dict(m) if isinstance(m, dict) else m for m in messages]
        return messages


class Trajectory(_Model):
    """The steps of one agent in one rollout, and its scalar reward."""

    steps: list[Step]
    reward: float
    name: str = "default"

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, reward: float) -> float:
        if not math.isfinite(reward):
            raise ValueError(f"trajectory reward must be a finite number, got {reward}")
        return reward


class Episode(_Model):
    """One workflow run on one task, as the trainer recorded it."""

    task_id: str
    rollout_index: int
    trajectories: list[Trajectory] = Field(default_factory=list)
    status: EpisodeStatus = "ok"
    error: str | None = None
    policy_version: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)

    @property
    def reward(self) -> float:
        """The episode's reward: the sum of its trajectories' rewards."""
        return sum(t.reward for t in self.trajectories)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any token of this episode came from."""
        versions = [s.output.oldest_version for t in self.trajectories for s in t.steps]
        return min([self.policy_version, *versions])


class TrajectoryGroup(_Model):
    """The `group_size` rollouts of one task: the unit that is filtered, advantaged and trained.

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
