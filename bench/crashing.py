"""Crash harness: train countdown in child processes, SIGKILL them at chosen phases, resume.

Used by `tests/test_crash.py` and `bench/crash_soak.py`; not product code. A child is forked from a
`forkserver` that has torch and the trainer imported, so a life costs a fork and the tiny model's
build, not an interpreter start. The child's backend (`PhaseReportingLocalBackend`, the real local
backend) reports each entry into generation, training, weight sync and checkpoint writing over a
pipe and waits for the parent's go, so the parent can kill it exactly there (the child is then
paused inside the phase) or a random moment after. Every life resumes the same run directory
(`resume=true`); `check_run` then states what an uninterrupted run guarantees: steps continuous,
every dispatched group ended exactly once, every task drawn from the sampler accounted for, and
nothing half-written visible.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from backends.local.backend import LocalBackend
from examples.countdown.workflow import CountdownWorkflow
from unified.checkpoint import LedgerEntry, RunDirectory
from unified.config import LoggingConfig, TrainerConfig, load_config
from unified.data import TaskSampler, load_tasks
from unified.protocol import TokenSampler
from unified.records import EpisodeRecord, StepRecord, read_records
from unified.types import ModelOutput, SamplingParams, Task, TrajectoryGroup

Phase = Literal["generation", "training", "sync", "checkpoint"]
PHASES: tuple[Phase, ...] = ("generation", "training", "sync", "checkpoint")

_LIFE_TIMEOUT_S = 120.0
_GO = b"g"


class ShapedCountdownWorkflow(CountdownWorkflow):
    """Countdown plus a small credit per digit in the reply: an untrained tiny model earns no
    countdown reward, and this keeps some groups trained and some filtered (equal rewards)."""

    def reward(self, task: Task, reply: str) -> tuple[float, bool]:
        reward, correct = super().reward(task, reply)
        return reward + 0.01 * sum(c.isdigit() for c in reply), correct


class _ReportingSampler:
    def __init__(self, inner: TokenSampler, report: Callable[[Phase], None]) -> None:
        self._inner = inner
        self._report = report

    @property
    def tokenizer(self) -> Any:
        return self._inner.tokenizer

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        self._report("generation")
        return await self._inner.sample(prompt_ids, params)


class PhaseReportingLocalBackend(LocalBackend):
    """The local backend, calling `report(phase)` on entering each phase (blocking: the parent
    may answer only by killing the process)."""

    def __init__(self, report: Callable[[Phase], None]) -> None:
        super().__init__()
        self.report = report

    def token_sampler(self) -> TokenSampler:
        return _ReportingSampler(super().token_sampler(), self.report)

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        self.report("training")
        return await super().forward_backward(groups)

    async def optim_step(self) -> dict[str, float]:
        self.report("training")
        return await super().optim_step()

    async def on_policy_updated(self, version: int) -> None:
        self.report("sync")
        await super().on_policy_updated(version)

    async def save_checkpoint(self, directory: Path) -> None:
        self.report("checkpoint")
        await super().save_checkpoint(directory)


def countdown_config(run_dir: Path, name: str, mode: str, **trainer: Any) -> dict[str, Any]:
    """A countdown run on the local backend small enough to train a step in a fraction of a
    second on a loaded CPU, checkpointing every other step; 8 steps unless `total_steps=`."""
    return {
        "name": name,
        "backend": "local",
        "mode": mode,
        "workflow": "bench.crashing:ShapedCountdownWorkflow",
        "model": "builtin:tiny",
        "data": {"train": {"generator": "examples.countdown.tasks:make_tasks", "n": 64}},
        "trainer": {
            "total_steps": 8,
            "batch_size": 2,
            "group_size": 3,
            "lr": 1e-3,
            "eval_every": 0,
            "eval_before_train": False,
            "save_every": 2,
            "stall_timeout_s": 90,
            "workflow_timeout_s": 60,
            **trainer,
        },
        "async": {"max_staleness": 1, "sync_every": 1},
        "sampling": {"train": {"max_tokens": 6}},
        "local": {"threads": 1},
        "logging": {"run_dir": str(run_dir), "console": False, "record_every": 1},
        "resume": True,
    }


def _life(config: dict[str, Any], conn: Connection) -> None:
    """One life of a run in a child process: train (resuming), reporting phases on `conn`."""

    def report(phase: Phase) -> None:
        conn.send_bytes(phase.encode())
        conn.recv_bytes()

    from unified.trainer import UnifiedTrainer

    UnifiedTrainer(config, backend=PhaseReportingLocalBackend(report)).fit()


@dataclass(frozen=True)
class Kill:
    """SIGKILL the child at the `occurrence`-th entry into `phase` of its life, `delay_s` after
    (0: while it waits, paused on entry)."""

    phase: Phase
    occurrence: int
    delay_s: float


def random_kills(rng: random.Random, phases: tuple[Phase, ...], count: int) -> list[Kill]:
    """`count` kills at random phases, occurrences and delays (a third of them on entry).

    Each falls within the first two steps its life runs (generation of the first step, training
    and sync of the first two, the first checkpoint write), so a life moves the run on by at most
    two steps and a run of `2 * count` steps lives through all the kills.
    """
    most = {"generation": 4, "training": 3, "sync": 2, "checkpoint": 1}
    kills = []
    for _ in range(count):
        phase = rng.choice(phases)
        delay_s = 0.0 if rng.random() < 1 / 3 else rng.uniform(0.0, 0.02)
        kills.append(Kill(phase, rng.randint(1, most[phase]), delay_s))
    return kills


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["bench.crashing", "unified.trainer", "torch"])
    return context


def run_life(config: dict[str, Any], kill: Kill | None) -> bool:
    """Run one life; kill it as `kill` says. True if it was killed, False if it finished."""
    context = _context()
    parent, child = context.Pipe()
    process = context.Process(target=_life, args=(config, child), daemon=True)
    process.start()
    child.close()
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + _LIFE_TIMEOUT_S
    try:
        while True:
            if not parent.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a life of {config['name']!r} ran past {_LIFE_TIMEOUT_S} s")
            try:
                phase = parent.recv_bytes().decode()
            except EOFError:
                break
            seen[phase] += 1
            if kill is not None and phase == kill.phase and seen[phase] == kill.occurrence:
                if kill.delay_s:
                    parent.send_bytes(_GO)
                    # The kill lands somewhere inside or after the phase; the child may pause
                    # at its next phase entry meanwhile, which is also a moment to die at.
                    parent.poll(kill.delay_s)
                process.kill()
                process.join(_LIFE_TIMEOUT_S)
                return True
            parent.send_bytes(_GO)
    finally:
        parent.close()
        if process.is_alive():
            process.kill()
        process.join(_LIFE_TIMEOUT_S)
    if process.exitcode != 0:
        raise RuntimeError(f"a life of {config['name']!r} exited with {process.exitcode}")
    return False


def train_with_kills(config: dict[str, Any], kills: list[Kill]) -> int:
    """Run lives until the run completes, killing one life per entry of `kills`; return the
    number of kills that happened (a life that finished before its kill point skips it)."""
    killed = 0
    for kill in kills:
        if not run_life(config, kill):
            return killed
        killed += 1
    run_life(config, None)
    return killed


@dataclass
class RunCheck:
    """What `check_run` found: problems (none for a sound run) and group counts."""

    problems: list[str]
    groups: int
    lost: int
    duplicated: int


def check_run(config_dict: dict[str, Any]) -> RunCheck:
    """The invariants of a finished run, resumed or not."""
    config: TrainerConfig = load_config(config_dict)
    settings = config.trainer
    run = RunDirectory(config.run_path)
    problems: list[str] = []
    steps = [int(line["step"]) for line in _jsonl(run.path / "metrics.jsonl")]
    if steps != list(range(1, settings.total_steps + 1)):
        problems.append(f"metrics steps are {steps}, not 1..{settings.total_steps}")
    entries = run.read_ledger()
    ids = Counter(e.group_id for e in entries)
    duplicated = sum(n - 1 for n in ids.values())
    if duplicated:
        problems.append(f"groups ended twice: {sorted(g for g, n in ids.items() if n > 1)}")
    per_step = Counter(e.step for e in entries if e.outcome == "trained")
    expected_steps = {step: settings.batch_size for step in range(1, settings.total_steps + 1)}
    if per_step != expected_steps:
        problems.append(f"trained groups per step {dict(per_step)}, expected {expected_steps}")
    # Every group dispatched got the next sequence number and the sampler's next task, or a
    # requeued group's task, or was dispatched again under its own: at the end all of them
    # ended, each once, and every task drawn ended once other than requeued. Groups requeued in
    # the last step (admitted beyond what it needed) are not dispatched again: their tasks are
    # the final checkpoint's groups in flight, first to go if the run is extended.
    final = RunDirectory.load_state(run.checkpoints / f"step_{settings.total_steps:06d}")
    left = Counter(final.redispatch)
    last_step = settings.total_steps
    requeued_last = Counter(
        e.task_id for e in entries if e.outcome == "requeued" and e.step == last_step
    )
    if left - requeued_last or any(seq is not None for seq in final.redispatch_seqs):
        problems.append(
            f"the final checkpoint still has groups in flight {final.redispatch} (numbers "
            f"{final.redispatch_seqs}); only tasks requeued in the last step may wait there"
        )
    seqs = Counter(int(g[1 : g.index("-")]) for g in ids)
    lost = len(set(range(final.next_seq)) - set(seqs))
    if lost or set(seqs) != set(range(final.next_seq)):
        problems.append(f"group sequence numbers {sorted(seqs)}, expected 0..{final.next_seq - 1}")
    sampler = TaskSampler(load_tasks(config.data.train), seed=settings.seed)
    # A requeued group's task is dispatched again under a new number (not drawn), unless left.
    dispatched_again = sum(e.outcome == "requeued" for e in entries) - left.total()
    drawn = Counter(task.id for task in sampler.take(final.next_seq - dispatched_again))
    ended = Counter(e.task_id for e in entries if e.outcome != "requeued") + left
    if drawn != ended:
        problems.append(
            f"tasks drawn but not ended: {sorted((drawn - ended).elements())}, "
            f"ended but not drawn: {sorted((ended - drawn).elements())}"
        )
    problems += _records_problems(run.path, entries, settings.total_steps, config.logging)
    leftovers = [p.name for p in run.checkpoints.iterdir() if not p.name.startswith("step_")]
    if leftovers:
        problems.append(f"temporary checkpoint directories left behind: {leftovers}")
    return RunCheck(problems, groups=len(entries), lost=lost, duplicated=duplicated)


def _records_problems(
    run_dir: Path, entries: list[LedgerEntry], total_steps: int, logging: LoggingConfig
) -> list[str]:
    """The rollout records of a finished run say what its ledger says, each thing once: a
    timeline line per step, and each recorded group's episodes under the outcome and step of
    its one ledger line (every `record_every`-th group with finished episodes is there)."""
    records, _ = read_records(run_dir)
    problems = []
    steps = [r.step for r in records if isinstance(r, StepRecord)]
    if steps != list(range(1, total_steps + 1)):
        problems.append(f"records have step lines {steps}, not 1..{total_steps}")
    ledger = {e.group_id: (e.outcome, e.step) for e in entries}
    seen: Counter[tuple[str, int]] = Counter()
    recorded: set[str] = set()
    for r in records:
        if isinstance(r, EpisodeRecord) and r.outcome != "eval":
            seen[(r.group_id, r.index)] += 1
            recorded.add(r.group_id)
            if ledger.get(r.group_id) != (r.outcome, r.step):
                problems.append(
                    f"episode {r.group_id}/{r.index} recorded as {r.outcome} in step {r.step}, "
                    f"ledger says {ledger.get(r.group_id)}"
                )
    twice = sorted(key for key, n in seen.items() if n > 1)
    if twice:
        problems.append(f"episodes recorded twice: {twice}")
    every = logging.record_every
    missing = [
        e.group_id
        for e in entries
        if every
        and int(e.group_id[1 : e.group_id.index("-")]) % every == 0
        and e.outcome != "requeued"
        and e.group_id not in recorded
    ]
    if missing:
        problems.append(f"groups that should be in the records are not: {missing}")
    return problems


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def final_tensors(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the run's final checkpoint: policy, sampler copy, optimizer and RNG."""
    from safetensors.torch import load_file

    config = load_config(config_dict)
    backend = config.run_path / "checkpoints" / f"step_{config.trainer.total_steps:06d}" / "backend"
    return {
        f"{path.stem}/{name}": tensor
        for path in sorted(backend.glob("*.safetensors"))
        for name, tensor in load_file(path).items()
    }
