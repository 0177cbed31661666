"""Rollout records: what the policy wrote, what trained, and when, under `runs/<name>/records/`.

One JSON object per line, its `type` first (the models below are the schema, and what
`unified report` validates each line against):

- `run`: a `fit` started or resumed: the wall-clock time, the step it starts from.
- `episode`: one episode of a recorded group (every `logging.record_every`-th dispatched,
  whatever its outcome) or of an evaluation (all of them, `logging.record_eval`): the task, the
  outcome, reward and advantage, and per model call the prompt text new at that call (masked
  from the loss) and the sampled tokens with their ids, text pieces, sampler logprobs and
  policy versions; the timing of its dispatch, workflow and calls.
- `step`: one optimizer step's timeline (waiting, `forward_backward`, `optim_step`, the weight
  sync) and the versions it trained onto and synced to.
- `eval`: one evaluation: when it ran, its accuracy.
- `save`: one checkpoint written.

`RecordWriter` builds and writes the lines on a thread of its own, never on the event loop.
Files are gzip streams of JSON lines (`zcat records/*.gz | jq`), each write one gzip member of
whole lines, so a kill can tear only the last member of the newest file; their names carry the
number of the first line they hold (`records-000000000.jsonl.gz`); a file rotates past
`records_max_mb / 8` and the oldest go past `records_max_mb`. A checkpoint keeps the number of
lines written; resume cuts the lines after it, as it rewinds the ledger, so a group's episodes
are recorded once, with its ledger line.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

from unified.errors import StallError
from unified.threads import DaemonWorker
from unified.types import CallTimes, Episode, EpisodeStatus, Task, Trajectory

if TYPE_CHECKING:
    from unified.groups import GroupTicket

__all__ = [
    "EpisodeRecord",
    "EvalRecord",
    "RecordWriter",
    "RunRecord",
    "SaveRecord",
    "StepRecord",
    "StepTimeline",
    "TimingRecord",
    "TurnRecord",
    "record_files",
    "truncate_records",
]

RECORDS_DIR = "records"
FLUSH_EVERY_S = 1.0
FLUSH_EPISODES = 256
"""The writer thread gets the queued records once a step when `FLUSH_EVERY_S` passed or
`FLUSH_EPISODES` episodes wait, and at every drain (a checkpoint drains what it keeps). Each
hand-off costs the event loop GIL switches; each episode waiting keeps its objects alive, and
the garbage collector's young collections walk them all."""
EpisodeOutcome = Literal["trained", "filtered", "failed", "requeued", "eval"]
SpanKind = Literal["wait", "forward", "optim", "sync"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunRecord(_Record):
    """A `fit` started at `started` (wall clock) from `step` (0, or the checkpoint resumed)."""

    type: Literal["run"] = "run"
    started: float
    step: int
    mode: str
    backend: str


class TurnRecord(_Record):
    """One model call: the prompt text new at this call (the whole prompt when it starts a new
    sequence; tool results and template tokens are here, never trained), then the sampled
    tokens, each with its text piece, the sampler's logprob and the version that sampled it."""

    trajectory: str = "default"
    prompt: str
    prompt_tokens: int
    ids: list[int]
    pieces: list[str]
    logprobs: list[float]
    versions: list[int]
    finish: str
    reward: float = 0.0
    info: dict[str, Any] = Field(default_factory=dict)


class TimingRecord(_Record):
    """Wall-clock times of an episode: its group's dispatch, its workflow's start and end (the
    wait for a slot is between the first two), and each model call's request and reply, with
    its first and last token's between where the sampler reports them (`CallTimes`)."""

    dispatched: float
    started: float
    ended: float
    calls: list[CallTimes] = Field(default_factory=list)


class EpisodeRecord(_Record):
    """One episode. `outcome` is its group's; `trained` whether its tokens carried a loss (an
    episode that failed, or one `keep_per_group` left out, did not)."""

    type: Literal["episode"] = "episode"
    step: int
    group_id: str
    task_id: str
    task: dict[str, Any]
    index: int
    outcome: EpisodeOutcome
    trained: bool
    status: EpisodeStatus
    error: str | None = None
    reward: float
    advantage: float | None = None
    correct: bool | None = None
    policy_version: int
    trainer_version: int
    turns: list[TurnRecord]
    timing: TimingRecord | None = None


class StepRecord(_Record):
    """Optimizer step `step`: trained onto the weights of `trained_at`, synced (if it did) to
    `synced_to`; `spans` are its (kind, start, end) intervals in wall-clock seconds."""

    type: Literal["step"] = "step"
    step: int
    trained_at: int
    synced_to: int | None = None
    spans: list[tuple[SpanKind, float, float]]


class EvalRecord(_Record):
    """The evaluation after `step` (0: before training), from `start` to `end`."""

    type: Literal["eval"] = "eval"
    step: int
    start: float
    end: float
    accuracy: float
    episodes: int


class SaveRecord(_Record):
    """The checkpoint of `step`, written from `start` to `end`."""

    type: Literal["save"] = "save"
    step: int
    start: float
    end: float


Record = RunRecord | EpisodeRecord | StepRecord | EvalRecord | SaveRecord
RECORD_TYPES: dict[str, type[_Record]] = {
    "run": RunRecord,
    "episode": EpisodeRecord,
    "step": StepRecord,
    "eval": EvalRecord,
    "save": SaveRecord,
}


class StepTimeline:
    """The spans of the step in progress: the loop wraps each phase in `span(kind)`. Durations
    come from the monotonic clock; spans are kept in wall-clock seconds, for the timeline."""

    def __init__(self) -> None:
        self.spans: list[tuple[SpanKind, float, float]] = []
        self._wall_offset = time.time() - time.monotonic()

    @contextmanager
    def span(self, kind: SpanKind) -> Iterator[None]:
        """Time the block as one `kind` span (kept even if the block raises)."""
        start = time.monotonic()
        try:
            yield
        finally:
            offset = self._wall_offset
            self.spans.append((kind, start + offset, time.monotonic() + offset))

    def seconds(self, kind: SpanKind) -> float:
        """Total seconds of the `kind` spans so far."""
        return sum(end - start for k, start, end in self.spans if k == kind)

    def take(self) -> list[tuple[SpanKind, float, float]]:
        """The spans so far; the next step starts with none."""
        spans, self.spans = self.spans, []
        return spans


class RecordWriter:
    """Writes the records of one run from a thread of its own, in the order they are handed in.

    The event loop only decides what to record (a group's sequence number against
    `record_every`) and queues the objects; turning episodes into lines (decoding text pieces
    with `tokenizer`) and the disk writes happen on the thread.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        every: int,
        eval_episodes: bool,
        max_mb: float,
        lines: int = 0,
        enabled: bool = True,
    ) -> None:
        self.directory = run_dir / RECORDS_DIR
        self.enabled = enabled
        self.every = every if enabled else 0
        self.eval_episodes = eval_episodes and enabled
        self.tokenizer: Any = None
        """Decodes the text pieces; set once the backend is up (no text without it)."""
        self._pieces: dict[int, str] = {}
        self._last_decoded: tuple[list[int], str] = ([], "")
        self._max_bytes = int(max_mb * 2**20)
        self._file_bytes = max(1, self._max_bytes // 8)
        self.lines = lines
        """Lines written so far (counting files since removed): a checkpoint keeps it."""
        self._files: list[list[Any]] | None = None  # [first line, path, bytes], oldest first
        self._file: BinaryIO | None = None  # the newest file, open for appending
        self._flushed = time.monotonic()
        self._writer = DaemonWorker("unified-records") if enabled else None
        self._pending: list[asyncio.Future[None]] = []
        self._batch: list[Any] = []  # builds queued since the last flush
        self._queued = 0  # episodes in them

    def records_group(self, seq: int) -> bool:
        """Whether the group dispatched `seq`-th has its episodes recorded."""
        return self.every > 0 and seq % self.every == 0

    # -- what happened (called on the event loop: queue only) -------------------------------------

    def run_started(self, step: int, mode: str, backend: str) -> None:
        """A `fit` starts (or resumes) from `step`."""
        started = time.time()
        self._submit(lambda: [RunRecord(started=started, step=step, mode=mode, backend=backend)])

    def group(
        self,
        step: int,
        ticket: GroupTicket,
        outcome: EpisodeOutcome,
        trainer_version: int,
        episodes: Sequence[Episode],
        advantages: dict[int, float] | None = None,
    ) -> None:
        """Record the `episodes` of the group of `ticket`, which ended (`outcome`) in `step`;
        `advantages` by rollout index for the episodes it trained on."""
        task = ticket.task.data if ticket.task is not None else {}
        trained = advantages or {}
        self._queued += len(episodes)

        def build() -> list[dict[str, Any]]:
            return [
                self._episode_record(
                    e,
                    step=step,
                    group_id=ticket.group_id,
                    task=task,
                    outcome=outcome,
                    trainer_version=trainer_version,
                    dispatched=ticket.dispatched,
                    advantage=trained.get(e.rollout_index),
                )
                for e in episodes
            ]

        self._submit(build)

    def step(
        self,
        step: int,
        spans: list[tuple[SpanKind, float, float]],
        *,
        trained_at: int,
        synced_to: int | None,
    ) -> None:
        """The timeline of optimizer step `step`; what was recorded goes to the writer when
        `FLUSH_EVERY_S` passed or `FLUSH_EPISODES` wait."""
        self._submit(
            lambda: [StepRecord(step=step, trained_at=trained_at, synced_to=synced_to, spans=spans)]
        )
        if self._queued >= FLUSH_EPISODES or time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self._flush()

    def evaluated(
        self,
        step: int,
        start: float,
        end: float,
        accuracy: float,
        episodes: Sequence[tuple[Task, Episode, bool]],
        version: int,
    ) -> None:
        """The evaluation after `step`, and each of `episodes` (its task, the episode, whether
        it was correct): the loop keeps them only when `eval_episodes`."""
        pairs = list(episodes)

        def build() -> list[_Record | dict[str, Any]]:
            records: list[_Record | dict[str, Any]] = [
                EvalRecord(step=step, start=start, end=end, accuracy=accuracy, episodes=len(pairs))
            ]
            for task, episode, correct in pairs:
                records.append(
                    self._episode_record(
                        episode,
                        step=step,
                        group_id=f"eval-{step}-{task.id}",
                        task=task.data,
                        outcome="eval",
                        trainer_version=version,
                        dispatched=0.0,
                        advantage=None,
                        correct=correct,
                    )
                )
            return records

        self._submit(build)

    def saved(self, step: int, start: float, end: float) -> None:
        self._submit(lambda: [SaveRecord(step=step, start=start, end=end)])

    # -- waiting and closing ----------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> int:
        """Wait until every record handed in is written; the lines written. A write that
        failed raises here; a disk stuck past `timeout_s` ends the run with a `StallError`."""
        self._flush()
        pending, self._pending = self._pending, []
        try:
            async with asyncio.timeout(timeout_s):
                for future in pending:
                    await future
        except TimeoutError:
            raise StallError(
                f"writing the rollout records took over {timeout_s:g} s: the disk of the run "
                "directory is stuck; check it, or raise trainer.stall_timeout_s"
            ) from None
        return self.lines

    async def close(self, timeout_s: float) -> None:
        """Write what is queued, close the file, then end the thread."""
        try:
            await self.drain(timeout_s)
        finally:
            writer, self._writer = self._writer, None
            if writer is not None:  # a second close finds nothing to do
                writer.submit(self._close_file)
                writer.close()

    # -- on the writer thread ---------------------------------------------------------------------

    def _submit(self, build: Any) -> None:
        """Queue `build` (it makes the lines); the writer gets a step's worth at a time."""
        if self._writer is not None:
            self._batch.append(build)

    def _flush(self) -> None:
        """Hand the queued builds to the writer thread: one wake-up and one gzip member for
        all of them, not one per group (the thread's wake-ups and GIL hand-offs cost the
        trainer)."""
        self._flushed, self._queued = time.monotonic(), 0
        if self._writer is None or not self._batch:
            return
        builds, self._batch = self._batch, []
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        done = self._writer.submit(lambda: self._write([r for b in builds for r in b()]))
        self._pending.append(asyncio.wrap_future(done))

    def _write(self, records: list[_Record | dict[str, Any]]) -> None:
        """Append `records` as one gzip member (the writer thread: never on the event loop)."""
        if not records:
            return
        # pydantic-core serialises in a quarter of `json.dumps`'s time; level 1 compresses in a
        # third of the default's, for files a quarter larger.
        member = gzip.compress(b"".join(to_json(r) + b"\n" for r in records), 1, mtime=0)
        if self._files is None:  # the first write: what a resumed run kept is there already
            self.directory.mkdir(parents=True, exist_ok=True)
            self._files = [
                [first, path, path.stat().st_size] for first, path in record_files(self.directory)
            ]
        files = self._files
        if not files or files[-1][2] >= self._file_bytes:
            files.append([self.lines, self.directory / f"records-{self.lines:09d}.jsonl.gz", 0])
            self._close_file()
        current = files[-1]
        if self._file is None:  # kept open: each open and close is one more GIL hand-off
            self._file = current[1].open("ab")
        try:
            self._file.write(member)
            self._file.flush()  # whole members reach the file: a kill tears at most the last
        except BaseException:
            with contextlib.suppress(OSError):  # the write's own error is the one to raise
                self._close_file()  # the file reopens for the next write: a torn end stays last
            raise
        current[2] += len(member)
        self.lines += len(records)
        while len(files) > 1 and sum(size for _, _, size in files) > self._max_bytes:
            files.pop(0)[1].unlink()  # the oldest go first

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def _episode_record(
        self,
        episode: Episode,
        *,
        step: int,
        group_id: str,
        task: dict[str, Any],
        outcome: EpisodeOutcome,
        trainer_version: int,
        dispatched: float,
        advantage: float | None,
        correct: bool | None = None,
    ) -> dict[str, Any]:
        """An `EpisodeRecord`'s line, built as a plain dict: validating a pydantic model per
        episode would cost the trainer more than the whole rest of the record (the reader
        validates; `tests/test_records.py` checks the two agree)."""
        timing = None
        if episode.timing is not None:
            t = episode.timing
            timing = {
                "dispatched": dispatched or t.started,
                "started": t.started,
                "ended": t.ended,
                "calls": t.calls,
            }
        return {
            "type": "episode",
            "step": step,
            "group_id": group_id,
            "task_id": episode.task_id,
            "task": task,
            "index": episode.rollout_index,
            "outcome": outcome,
            "trained": outcome == "trained" and advantage is not None,
            "status": episode.status,
            "error": episode.error,
            "reward": episode.reward,
            "advantage": advantage,
            "correct": correct,
            "policy_version": episode.policy_version,
            "trainer_version": trainer_version,
            "turns": [turn for t in episode.trajectories for turn in self._turns(t)],
            "timing": timing,
        }

    def _turns(self, trajectory: Trajectory) -> list[dict[str, Any]]:
        """Each model call of `trajectory` as a `TurnRecord`'s dict, its prompt cut to what is
        new since the call before (when it extends that call's prompt and completion, as a
        multi-turn chat's does)."""
        turns: list[dict[str, Any]] = []
        seen: list[int] = []
        for step in trajectory.steps:
            out = step.output
            prompt = out.prompt_ids
            new = prompt[len(seen) :] if seen and prompt[: len(seen)] == seen else prompt
            ids = out.completion_ids
            turns.append(
                {
                    "trajectory": trajectory.name,
                    "prompt": self._decode(new),
                    "prompt_tokens": len(new),
                    "ids": ids,
                    "pieces": self._pieces_of(ids),
                    # To 1e-4, toward zero: a third of `round`'s time, as exact for reading.
                    "logprobs": [int(lp * 10_000) / 10_000 for lp in out.logprobs],
                    "versions": out.token_versions or [out.policy_version] * len(ids),
                    "finish": out.finish_reason,
                    "reward": step.reward,
                    "info": _plain(step.info) if step.info else {},
                }
            )
            seen = [*prompt, *ids]
        return turns

    def _decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:
            return ""
        if ids == self._last_decoded[0]:  # a group's episodes share their prompt
            return self._last_decoded[1]
        text = self._decode_new(ids)
        self._last_decoded = (ids, text)
        return text

    def _decode_new(self, ids: list[int]) -> str:
        try:
            return str(self.tokenizer.decode(ids))
        except Exception as e:  # a record must not take the run down
            return f"<{len(ids)} tokens; decode failed: {type(e).__name__}>"

    def _pieces_of(self, ids: list[int]) -> list[str]:
        """Each token's text piece (decoded once per token id, then looked up)."""
        pieces = self._pieces
        found: list[str | None] = list(map(pieces.get, ids))
        if None not in found:
            return found  # type: ignore[return-value]
        for i, token in enumerate(ids):
            if found[i] is None:
                piece = pieces.get(token)
                if piece is None:
                    piece = pieces[token] = self._decode_new([token])
                found[i] = piece
        return found  # type: ignore[return-value]


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """The JSON-plain entries of a step's `info`, long strings cut (a record stays small)."""
    plain: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, str):
            plain[key] = value if len(value) <= 500 else value[:500] + "..."
        elif value is None or isinstance(value, bool | int | float):
            plain[key] = value
    return plain


def record_files(directory: Path) -> list[tuple[int, Path]]:
    """The record files of `directory`, oldest first, each with the number of its first line."""
    if not directory.is_dir():
        return []
    files = []
    for path in directory.glob("records-*.jsonl.gz"):
        digits = path.name.removeprefix("records-").removesuffix(".jsonl.gz")
        if digits.isdigit():
            files.append((int(digits), path))
    return sorted(files)


def _members(path: Path) -> tuple[list[str], bool]:
    """The lines of a record file, and whether its last gzip member is torn (left out)."""
    data = path.read_bytes()
    lines: list[str] = []
    while data:
        member = zlib.decompressobj(wbits=31)  # one gzip member
        try:
            text = member.decompress(data)
        except zlib.error:
            if not lines and not data.startswith(b"\x1f\x8b"):
                raise RecordError(f"{path}: not a gzip file; the file is damaged") from None
            return lines, True
        if not member.eof:
            return lines, True
        lines += text.decode("utf-8", errors="replace").split("\n")[:-1]
        data = member.unused_data
    return lines, False


def truncate_records(run_dir: Path, lines: int | None) -> int:
    """Keep the first `lines` record lines of `run_dir` (resume: what its checkpoint had
    seen; None: all, for a checkpoint from before records), and a member torn by a crash
    nowhere; returns the lines kept."""
    if lines is None:
        lines = sys.maxsize
    directory = run_dir / RECORDS_DIR
    kept = 0
    for first, path in record_files(directory):
        if first >= lines:
            path.unlink()
            continue
        try:
            text, torn = _members(path)
        except RecordError:  # damaged past reading: nothing of it is kept
            text, torn = [], True
        keep = text[: lines - first]
        if torn or len(keep) != len(text):
            data = "".join(line + "\n" for line in keep).encode()
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(gzip.compress(data, mtime=0) if keep else b"")
            os.replace(tmp, path)
        kept = first + len(keep)
    return kept


class RecordError(ValueError):
    """A record file that does not read: names the file, the line and what is wrong."""


def read_records(run_dir: Path) -> tuple[list[Record], list[str]]:
    """Every record of `run_dir`, validated, in order; and warnings (the end of the newest
    file torn by a kill is left out with one). A line that does not parse raises `RecordError`."""
    records: list[Record] = []
    warnings: list[str] = []
    files = record_files(run_dir / RECORDS_DIR)
    for number, (_, path) in enumerate(files):
        lines, torn = _members(path)
        if torn:
            if number == len(files) - 1:
                warnings.append(f"{path}: left out its torn end (a kill mid-write)")
            else:
                raise RecordError(
                    f"{path}: its end is cut short, and it is not the newest file; the file "
                    "was truncated or damaged: restore it, or delete it to report without it"
                )
        for index, line in enumerate(lines, start=1):
            if line.strip():
                records.append(_parse(line, path, index))
    return records, warnings


def _parse(line: str, path: Path, index: int) -> Record:
    where = f"{path}:{index}"
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordError(
            f"{where}: not JSON ({e.msg} at column {e.colno}); the file is damaged"
        ) from None
    kind = raw.get("type") if isinstance(raw, dict) else None
    model = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        known = ", ".join(RECORD_TYPES)
        raise RecordError(f"{where}: record type {kind!r} is none of {known}; the file is damaged")
    try:
        record: Record = model.model_validate(raw)  # type: ignore[assignment]
    except ValueError as e:
        first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
        field = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise RecordError(f"{where}: {kind} record: {field}: {first['msg']}") from None
    return record
