"""The run directory: resolved config, the group ledger, and atomic checkpoints.

`runs/<name>/config.yaml` is the resolved config, `ledger.jsonl` has one line per ended group,
and `checkpoints/step_NNNNNN/` a complete snapshot (trainer state + backend state). A checkpoint
is written into a temporary directory and renamed into place, so a reader never sees half of one.
Resuming rewinds the ledger and `metrics.jsonl` to what the checkpoint had seen, so work redone
after a crash is recorded once; a line torn by a crash mid-write is always past that point.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict

from unified.errors import UsageError
from unified.records import truncate_records

log = logging.getLogger(__name__)

__all__ = ["LedgerEntry", "RunDirectory", "TrainerState"]

_STATE_FILE = "trainer_state.json"
_BACKEND_DIR = "backend"


Outcome = Literal["trained", "filtered", "failed", "requeued"]
"""How a group ended: trained, or untrained (equal rewards, failed episodes, missed deadline)."""


class LedgerEntry(BaseModel):
    """One ended group. Its staleness is `trainer_version - policy_version` (trained groups)."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    task_id: str
    outcome: Outcome
    step: int
    policy_version: int
    trainer_version: int
    reason: str = ""


class TrainerState(BaseModel):
    """What the trainer needs to continue a run exactly where a checkpoint left it."""

    model_config = ConfigDict(extra="forbid")

    step: int
    version: int
    next_seq: int
    sampler: dict[str, int]
    redispatch: list[str] = []
    """Ids of tasks dispatched but not yet ended at save time; dispatched again on resume."""
    redispatch_seqs: list[int | None] = []
    """The groups' dispatch sequence numbers, in the order of `redispatch`: a group dispatched
    again keeps its id and rollout seeds, so a resumed sync run trains what an uninterrupted one
    trains; None for a requeued group's task, which gets a new number when dispatched."""
    entropy_coef: float | None = None
    """The adaptive entropy coefficient after `step` (`trainer.entropy_target`); None without."""
    ledger_lines: int | None = None
    """Ledger lines written before this checkpoint; resume drops the lines after them."""
    records_lines: int | None = None
    """Rollout record lines written before this checkpoint; resume drops the lines after them."""


class RunDirectory:
    """Owns `runs/<name>/`: creates it, appends to the ledger, saves and finds checkpoints."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.ledger_path = path / "ledger.jsonl"
        self.ledger_lines = 0
        """Lines in the ledger: those kept on resume plus those appended since."""
        self.records_lines = 0
        """Rollout record lines kept on resume (`unified.records`)."""
        self.resumed_step: int | None = None
        """With resume: the checkpoint's step (-1 without one); later steps' metrics are redone."""
        self.created = False
        """Whether `create` made the directory (so a run that trains nothing may remove it)."""

    def create(
        self,
        config_yaml: str,
        *,
        resume: bool,
        check_state: Callable[[TrainerState], None] | None = None,
    ) -> Path | None:
        """Make the directory and write `config.yaml`; refuse to overwrite an unrelated run.

        With `resume`, return the newest complete checkpoint (None if there is none) after
        dropping the ledger and metrics lines it does not hold (that work is redone) and the
        temporary directories of checkpoints a crash interrupted. `check_state` may refuse the
        checkpoint's state before anything of the run is changed.
        """
        self.created = False  # of this call: a refused second `fit` must not remove the first run
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(
                f"run directory {str(self.path)!r} is a file; check logging.run_dir and name"
            )
        if self.path.exists() and any(self.path.iterdir()) and not resume:
            raise UsageError(
                f"run directory {str(self.path)!r} already holds a run; set resume=true to "
                "continue it, pick another name=..., or delete the directory"
            )
        if resume:  # before config.yaml is rewritten: it is what says what the run trained
            ours = yaml.safe_load(config_yaml) or {}
            _check_made_by(
                self.path / "config.yaml",
                f"run {str(self.path)!r}",
                backend=ours.get("backend"),
                model=ours.get("model"),
                seed=(ours.get("trainer") or {}).get("seed"),
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.path.mkdir()
                self.created = True
            except FileExistsError:
                if not self.path.is_dir():
                    raise
                if any(self.path.iterdir()) and not resume:  # another process made it just now
                    raise UsageError(
                        f"run directory {str(self.path)!r} already holds a run; pick another "
                        "name=..."
                    ) from None
        except (FileExistsError, NotADirectoryError):
            raise UsageError(
                f"cannot make run directory {str(self.path)!r}: a file is in the way; check "
                "logging.run_dir and name"
            ) from None
        checkpoint = self.latest_checkpoint() if resume else None
        state = self.load_state(checkpoint) if checkpoint else None
        if state is not None and check_state is not None:
            check_state(state)
        _write_atomic(self.path / "config.yaml", config_yaml)
        if resume:
            self.resumed_step = state.step if state else -1
            self._truncate_ledger(state)
            self._truncate_metrics(self.resumed_step)
            kept = 0 if state is None else state.records_lines  # None: older, keep all
            self.records_lines = truncate_records(self.path, kept)
            for tmp in self.checkpoints.glob(".tmp-step_*"):
                shutil.rmtree(tmp)
        return checkpoint

    def append_ledger(self, entries: Iterable[LedgerEntry]) -> None:
        """Append ledger lines (blocking: call from a thread)."""
        lines = [e.model_dump_json() + "\n" for e in entries]
        if lines:
            with self.ledger_path.open("a") as f:
                f.write("".join(lines))
            self.ledger_lines += len(lines)

    def read_ledger(self) -> list[LedgerEntry]:
        """Every complete ledger line written so far."""
        return [LedgerEntry.model_validate_json(line) for line in _complete_lines(self.ledger_path)]

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint directory, if any: by step number, and one whose state
        reads (a state damaged by a crash of the machine falls back to the one before)."""
        if not self.checkpoints.is_dir():
            return None
        done = [p for p in self.checkpoints.glob("step_*") if (p / _STATE_FILE).is_file()]
        for checkpoint in sorted(done, key=_step_of, reverse=True):
            try:
                self.load_state(checkpoint)
            except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
                log.warning(
                    "checkpoint %s is unreadable (%s); trying the one before", checkpoint, e
                )
                continue
            return checkpoint
        return None

    async def save_checkpoint(
        self, state: TrainerState, save_backend: Callable[[Path], Awaitable[None]]
    ) -> Path:
        """Write a checkpoint for `state.step` atomically: temp directory, then rename."""
        final = self.checkpoints / f"step_{state.step:06d}"
        tmp = self.checkpoints / f".tmp-step_{state.step:06d}"
        await asyncio.to_thread(_fresh_dir, tmp)
        try:
            await save_backend(tmp / _BACKEND_DIR)
            await asyncio.to_thread(_write_atomic, tmp / _STATE_FILE, state.model_dump_json())
            await asyncio.to_thread(_sync_tree, tmp)  # on disk before it is visible as done
            await asyncio.to_thread(_replace_dir, tmp, final)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise
        return final

    @staticmethod
    def find_checkpoint(path: Path) -> Path:
        """`path` itself if it is a checkpoint, else the newest checkpoint of the run at `path`."""
        if (path / _STATE_FILE).is_file():
            return path
        latest = RunDirectory(path).latest_checkpoint()
        if latest is None:
            raise UsageError(
                f"{str(path)!r} is neither a checkpoint (runs/<name>/checkpoints/step_N) nor a "
                "run directory holding one; runs write one after the last step unless "
                "trainer.save_final=false (and every trainer.save_every steps)"
            )
        return latest

    @staticmethod
    def check_matches(checkpoint: Path, *, backend: str, model: str) -> None:
        """Refuse a checkpoint whose run trained another backend or model (its `config.yaml`)."""
        made_by = checkpoint.parent.parent / "config.yaml"
        _check_made_by(made_by, f"checkpoint {str(checkpoint)!r}", backend=backend, model=model)

    @staticmethod
    async def load_checkpoint(
        checkpoint: Path, load_backend: Callable[[Path], Awaitable[None]]
    ) -> TrainerState:
        """Hand a checkpoint's backend part to `load_backend`; return its trainer state."""
        state = await asyncio.to_thread(RunDirectory.load_state, checkpoint)
        await load_backend(checkpoint / _BACKEND_DIR)
        return state

    @staticmethod
    def load_state(checkpoint: Path) -> TrainerState:
        """Read the trainer state of a checkpoint directory."""
        return TrainerState.model_validate_json((checkpoint / _STATE_FILE).read_text())

    def _truncate_ledger(self, state: TrainerState | None) -> None:
        """Keep the ledger lines written before the checkpoint of `state` (none without one).

        The groups of later lines were in flight or not yet sampled at that checkpoint, so the
        resumed run ends them again. Checkpoints without a line count keep lines by step.
        """
        entries = self.read_ledger()
        if state is None:
            kept = []
        elif state.ledger_lines is None:
            kept = [e for e in entries if e.step <= state.step]
        else:
            kept = entries[: state.ledger_lines]
        _write_atomic(self.ledger_path, "".join(e.model_dump_json() + "\n" for e in kept))
        self.ledger_lines = len(kept)

    def _truncate_metrics(self, after_step: int) -> None:
        """Drop metrics lines of steps after `after_step`."""
        path = self.path / "metrics.jsonl"
        if path.exists():
            lines = _complete_lines(path)
            kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= after_step]
            _write_atomic(path, "".join(ln + "\n" for ln in kept))


def _complete_lines(path: Path) -> list[str]:
    """The non-empty lines of `path` that end in a newline: a crash mid-append tears only the
    last line, which then lacks its newline and is left out."""
    if not path.exists():
        return []
    return [line for line in path.read_text().split("\n")[:-1] if line]


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    (path / _BACKEND_DIR).mkdir(parents=True)


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(src, dst)
    _sync_dir(dst.parent)


def _step_of(checkpoint: Path) -> int:
    digits = checkpoint.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under `root`: a power loss after the rename must not
    leave a checkpoint that looks complete with empty files."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(directory))


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_made_by(
    made_by: Path, what: str, *, backend: str | None, model: str | None, seed: int | None = None
) -> None:
    """Refuse to go on from `what` if its `config.yaml` names another backend, model or (when
    given) `trainer.seed`, which orders the tasks: another would train some twice."""
    if not made_by.is_file():
        return
    run_config = yaml.safe_load(made_by.read_text()) or {}
    if seed is not None:
        theirs_seed = (run_config.get("trainer") or {}).get("seed")
        if theirs_seed is not None and theirs_seed != seed:
            raise UsageError(
                f"{what} was trained with trainer.seed={theirs_seed!r}, but the config says "
                f"trainer.seed={seed!r}; pass trainer.seed={theirs_seed}"
            )
    for key, ours in (("backend", backend), ("model", model)):
        theirs = run_config.get(key)
        if theirs is not None and theirs != ours and not _same_directory(theirs, ours):
            raise UsageError(
                f"{what} was trained with {key}={theirs!r}, but the config says {key}={ours!r}; "
                f"pass {key}={theirs}"
            )


def _same_directory(a: object, b: object) -> bool:
    """Whether two model specs are spellings of one existing directory (`m/`, `./m`, `/abs/m`)."""
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return first.is_dir() and second.is_dir() and first.resolve() == second.resolve()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
