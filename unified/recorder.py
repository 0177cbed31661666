"""StepRecorder: what each step reports, and the thread that writes it.

The loop tells it what happened (an episode finished, groups ended, a backend replied, a step
trained); it keeps the counters, the failure policies that read them (`trainer.max_error_rate`,
`trainer.max_bad_steps`), the step's timing and idle ratios, the token accounting (generated,
trained, discarded; trained over generated length; each trained token's lag behind the weights),
and hands each step's line to the sinks on a thread of its own, in step order, off the training
path. Every wait on the sinks has
the `trainer.stall_timeout_s` deadline.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from unified.backend_calls import finite
from unified.config import TrainerConfig
from unified.errors import StallError, TrainingStopped
from unified.evaluation import episode_tool_calls
from unified.groups import EndedGroup, GroupTicket, TrajectoryGroupBuffer
from unified.metrics import MetricsAggregator, counted_quantile
from unified.schedule import learning_rate
from unified.threads import DaemonWorker
from unified.types import Episode, TrajectoryGroup

__all__ = ["StepRecorder"]


class StepRecorder:
    """Counters, failure policies, timing and the metrics writer of one `fit`."""

    def __init__(self, config: TrainerConfig, metrics: MetricsAggregator) -> None:
        self.config = config
        self.metrics = metrics
        self.last_metrics: dict[str, float] = {}
        self._episodes_done = 0
        self._episodes_failed = 0
        self._tokens = 0
        # Completion tokens and count of the usable episodes generated and trained so far: the
        # ratio of their means is the length bias of what trains.
        self._generated_lengths = [0, 0]
        self._trained_lengths = [0, 0]
        self._loss_finite = True
        self._bad_steps_in_a_row = 0
        self.started_at = self._step_started = self._rates_started = time.monotonic()
        # A daemon thread: a sink stuck for good (past `stall_timeout_s`) holds up no exit.
        self._writer = DaemonWorker("unified-metrics")
        self._writes: deque[asyncio.Future[None]] = deque()

    def start_clocks(self) -> None:
        """Training starts now: the time budget and the first step's timing count from here."""
        self.started_at = self._step_started = self._rates_started = time.monotonic()

    # -- what happened --------------------------------------------------------------------------

    def episode(self, episode: Episode, error: BaseException | None, tokens: int) -> None:
        """A training episode finished: count it, its tokens, its failure and its tool calls."""
        self._tokens += tokens
        self._episodes_done += 1
        if episode.status == "ok":  # its length: every token its model calls sampled
            self._generated_lengths[0] += tokens
            self._generated_lengths[1] += 1
        if error is not None:
            self._count_failure(episode, error)
        self._record_tool_calls(episode)

    def ended(self, groups: Sequence[EndedGroup]) -> None:
        """Groups that ended untrained: `groups/<outcome>`, and the rewards of those that ran."""
        for group in groups:  # (a requeued group has no rewards: its task runs again)
            self.metrics.record(f"groups/{group.outcome}", 1.0)
            self._record_rewards(group.rewards)

    def forward_reply(self, reply: dict[str, float]) -> None:
        """A `forward_backward` reply: its metrics, and whether its loss was finite."""
        self._loss_finite = self._loss_finite and finite(reply, "train/loss")
        self.metrics.record_many(reply)

    def optim_reply(self, reply: dict[str, float]) -> str:
        """An `optim_step` reply: "" for a good step, else the ledger's note on it (NaN/inf loss
        or gradient norm); past `max_bad_steps` bad steps in a row, stop the run."""
        skipped = reply.pop("train/skipped_steps", 0.0) > 0
        bad = skipped or not self._loss_finite or not finite(reply, "train/grad_norm")
        self._loss_finite = True
        self.metrics.record_many({**reply, "train/skipped_steps": float(bad)})
        if not bad:
            self._bad_steps_in_a_row = 0
            return ""
        self._bad_steps_in_a_row += 1
        limit = self.config.trainer.max_bad_steps
        if self._bad_steps_in_a_row > limit:
            grad_norm = reply.get("train/grad_norm", math.nan)
            raise TrainingStopped(
                f"{self._bad_steps_in_a_row} optimizer steps in a row had a NaN/inf loss or "
                f"gradient norm (last grad_norm={grad_norm:g}), more than trainer.max_bad_steps="
                f"{limit}: the policy diverged or the rewards/advantages are broken; lower "
                "trainer.lr, check the workflow's rewards, or raise trainer.max_bad_steps"
            )
        # A backend that cannot drop the gradients (tinker) applies the update anyway.
        done = "update skipped" if skipped else "update applied (the backend cannot skip it)"
        return f"{done}: non-finite loss or gradient norm"

    def time_up(self) -> bool:
        """Whether the `trainer.max_time_s` budget is spent (counted from `start_clocks`)."""
        budget = self.config.trainer.max_time_s
        return budget is not None and time.monotonic() - self.started_at >= budget

    def step_metrics(
        self,
        step: int,
        items: Sequence[tuple[GroupTicket, TrajectoryGroup]],
        groups: TrajectoryGroupBuffer,
        trained_at: int,
        *,
        wait_s: float,
        train_s: float,
        sync_s: float,
        engine_idle_s: float = 0.0,
    ) -> dict[str, float]:
        """The line of `step`, which trained `items` on the weights of `trained_at` and left
        `groups` at their version; `wait_s` waiting for groups, `train_s` training, `sync_s`
        syncing, `engine_idle_s` (since the last step) with no sampling request running. It
        takes the generation thrown away and the rollouts' idle time from `groups`."""
        version = groups.version
        rollout_idle_s = groups.take_idle_seconds()
        discarded = groups.take_discarded()
        for ticket, _ in items:
            self._record_rewards(ticket.rewards)
        staleness = [trained_at - group.policy_version for _, group in items]
        now = time.monotonic()
        step_s = now - self._step_started
        # The rollouts run on through evaluation and saving, which no step's time counts: their
        # rates cover the whole time since the last step's, so a slow save neither inflates them
        # nor hides the tokens made during it.
        rates_s, self._rates_started = now - self._rates_started, now
        self.metrics.record_many(
            {
                "groups/trained": float(len(items)),
                # Counters appear every step, zero or not, so curves have no gaps.
                "groups/filtered": 0.0,
                "episodes/errors": 0.0,
                "episodes/timeouts": 0.0,
                "groups/requeued": 0.0,
                **discarded,
                "staleness/mean": sum(staleness) / len(staleness),
                "staleness/max": float(max(staleness)),
                **self._token_accounting(items, trained_at),
                # After the run's last step: what its still-running groups had finished, which the
                # final checkpoint keeps as work in flight (their tasks go first on resume).
                **{f"{k}/in_flight_at_end": v for k, v in groups.in_flight_at_end.items() if v},
                "optim/lr": learning_rate(self.config.trainer, step - 1),
            }
        )
        per_step = 1.0 / step_s if step_s > 0 else 0.0
        per_interval = 1.0 / rates_s if rates_s > 0 else 0.0
        timing = {
            "step": float(step),
            "policy/version": float(version),
            "time/step": step_s,
            "time/generate": wait_s,
            "time/train": train_s,
            "time/sync": sync_s,
            "throughput/tokens_per_s": self._tokens * per_interval,
            # Every second not spent training or syncing, the trainer was waiting on something.
            "trainer/idle_ratio": max(0.0, step_s - train_s - sync_s) * per_step,
            "rollout/idle_ratio": min(1.0, rollout_idle_s * per_interval),
            "rollout/engine_idle_ratio": min(1.0, engine_idle_s * per_interval),
        }
        self._tokens = 0
        return {**self.metrics.flush(), **timing}

    def _token_accounting(
        self, items: Sequence[tuple[GroupTicket, TrajectoryGroup]], trained_at: int
    ) -> dict[str, float]:
        """Tokens generated since the last step and trained in this one, the trained episodes'
        mean length over the generated ones' (over the run so far: a step may generate no
        usable episode), and each trained token's lag: `trained_at` minus the version that
        sampled it."""
        versions: Counter[int] = Counter()
        trained = episodes = 0
        for _, group in items:
            for episode in group.episodes:
                episodes += 1
                for trajectory in episode.trajectories:
                    for step in trajectory.steps:
                        out = step.output
                        trained += len(out.completion_ids)
                        if out.token_versions:
                            versions.update(out.token_versions)
                        elif out.completion_ids:
                            versions[out.policy_version] += len(out.completion_ids)
        self._trained_lengths[0] += trained
        self._trained_lengths[1] += episodes
        line = {"tokens/generated": float(self._tokens), "tokens/trained": float(trained)}
        (trained_tokens, trained_episodes), (generated_tokens, generated) = (
            self._trained_lengths,
            self._generated_lengths,
        )
        if trained_episodes and generated and generated_tokens:
            mean_generated = generated_tokens / generated
            line["length/trained_over_generated"] = (
                trained_tokens / trained_episodes / mean_generated
            )
        if versions:
            lags = {trained_at - v: n for v, n in versions.items()}
            line["lag/token_mean"] = sum(lag * n for lag, n in lags.items()) / sum(lags.values())
            line["lag/token_p99"] = float(counted_quantile(lags, 0.99))
            line["lag/token_max"] = float(max(lags))
        return line

    def step_done(self) -> None:
        """The step's line is out: evaluation, logging and saving belong to no step's timing."""
        self._step_started = time.monotonic()

    # -- failure policy and per-episode metrics -------------------------------------------------

    def _count_failure(self, episode: Episode, error: BaseException) -> None:
        """Count a failed episode; past `max_error_rate`, re-raise its exception."""
        settings = self.config.trainer
        self._episodes_failed += 1
        key = "episodes/timeouts" if episode.status == "timeout" else "episodes/errors"
        self.metrics.record(key, 1.0)
        floor = settings.batch_size * settings.group_size
        if self._episodes_failed > settings.max_error_rate * max(self._episodes_done, floor):
            error.add_note(
                f"unified: {self._episodes_failed} of {self._episodes_done} episodes failed, "
                f"above trainer.max_error_rate={settings.max_error_rate:g}; training stopped"
            )
            raise error

    def _record_tool_calls(self, episode: Episode) -> None:
        """The `eval/tool_*` metrics of the training episodes, as `rollout/tool_*`: sampled at
        the training temperature, where calls garble first."""
        counted = episode_tool_calls(episode)
        if counted is None:
            return
        calls, errors = counted
        self.metrics.record_many(
            {
                "rollout/tool_calls": calls,
                "rollout/tool_use": calls > 0,
                "rollout/tool_use_well_formed": calls > 0 and errors == 0,
            }
        )
        if calls:  # a share of calls: left out of a step in which nothing was called
            well_formed = [1.0] * (calls - errors) + [0.0] * errors
            self.metrics.record_all("rollout/tool_calls_well_formed", well_formed)

    def _record_rewards(self, rewards: Sequence[float]) -> None:
        """Rewards of groups that ended this step (trained or not): `reward/mean`, `/std`."""
        self.metrics.record_all("reward/mean", rewards)
        self.metrics.record_all("reward/std", rewards)

    # -- the writer thread ----------------------------------------------------------------------

    async def log(self, step: int, metrics: dict[str, float]) -> None:
        """Hand `metrics` to the sinks' thread; a write that failed raises here (or later)."""
        self.last_metrics = metrics
        while self._writes and self._writes[0].done():
            self._writes.popleft().result()
        write = self._writer.submit(functools.partial(self.metrics.log, step, metrics))
        self._writes.append(asyncio.wrap_future(write))

    async def drain(self, step: int) -> None:
        """Wait until every line handed to the sinks is written (within `stall_timeout_s`)."""
        writes, self._writes = self._writes, deque()
        async with self._sink_deadline(f"writing the metrics of step {step}"):
            outcomes = await asyncio.gather(*writes, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def close(self, step: int) -> None:
        """Finish the writes, then close every sink (the sinks flush as they close)."""
        try:
            await self.drain(step)
        finally:
            try:  # behind any write still running (one past its deadline): never beside it
                async with self._sink_deadline("closing the metrics sinks"):
                    await self._writer.run(self.metrics.close)
            finally:
                self._writer.close()

    @asynccontextmanager
    async def _sink_deadline(self, what: str) -> AsyncIterator[None]:
        """`trainer.stall_timeout_s` for a wait on the metrics sinks (a W&B or network-filesystem
        write that never returns must end the run, not hang it)."""
        timeout_s = self.config.trainer.stall_timeout_s
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                yield
        except TimeoutError:
            if not deadline.expired():
                raise
            raise StallError(
                f"{what} took over {timeout_s:g} s: a metrics sink (W&B, TensorBoard, or the "
                "disk of the run directory) is stuck; check it, or raise trainer.stall_timeout_s"
            ) from None
