"""Task datasets and the resumable sampler that feeds them to the trainer.

`load_tasks` reads `data.train` / `data.eval` (a .jsonl/.json/.parquet file, a Hugging Face
dataset saved to disk, or a `{generator: module:fn, ...}` spec) into a list of `Task`s with
unique ids; every problem with the data is a `DataError` naming the source, the line or row, and
the fix. `TaskSampler` turns that list into an endless stream whose order is a pure function of
`(seed, epoch, index)`, so a checkpointed `state_dict` resumes exactly: no task twice, none lost.

Reading is blocking; the trainer calls `load_tasks` before the event loop or via `to_thread`.
pyarrow and datasets are imported only when a parquet file or dataset directory is read.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from unified.errors import DataError, UsageError
from unified.imports import import_object
from unified.types import Task

if TYPE_CHECKING:
    from unified.config import DataConfig

__all__ = ["SUPPORTED_SUFFIXES", "TaskSampler", "check_fields", "load_eval_tasks", "load_tasks"]

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")

# Keeps run seeds apart: seeds s and s+1 share no epoch permutation in their first million epochs.
_EPOCH_SEED_STRIDE = 1_000_003


def load_eval_tasks(data: DataConfig) -> list[Task]:
    """The tasks of `data.eval` (none when it is unset), at most `data.eval_limit` of them."""
    tasks = load_tasks(data.eval, what="data.eval") if data.eval else []
    return tasks[: data.eval_limit]


def load_tasks(
    source: str | Path | Mapping[str, Any] | None, *, what: str = "data.train"
) -> list[Task]:
    """Read every task of `source`; `what` names the config key in error messages.

    A file or dataset row becomes a `Task` by one rule: `id` is `str(row["id"])` if present, else
    `"<stem>-<n>"` (n the 1-based line, entry or row number; `"gen-<i>"`, 0-based, for generator
    dicts); `data` is `row["data"]` if the row is exactly `{id, data}`, else the row minus `id`.
    """
    if source is None:
        raise DataError(
            f"{what} is not set; give a .jsonl/.parquet file, a dataset directory, "
            "or {generator: module:fn}"
        )
    if isinstance(source, Mapping):
        label = f"generator {source.get('generator')!r}"
        tasks = _unique(_from_generator(source, what), what)
    else:
        path = Path(source).expanduser()
        label = str(path)
        tasks = _unique(_from_path(path, what), what)
    if not tasks:
        raise DataError(f"{what} is empty: {label} holds no tasks")
    return tasks


def check_fields(tasks: Iterable[Task], fields: Iterable[str], *, what: str) -> None:
    """Every task has the `fields` its workflow reads (the workflow's `required_fields`)."""
    wanted = tuple(fields)
    for task in tasks:
        for field in wanted:
            if field not in task.data:
                raise DataError(
                    f"{what}: task {task.id!r} has no field {field!r}, which the workflow reads "
                    f"(its required_fields); add it to every task (this one has: "
                    f"{', '.join(sorted(task.data)) or 'no fields'})"
                )


def _from_path(path: Path, what: str) -> Iterator[tuple[str, Task]]:
    if not path.exists():
        raise DataError(f"{what}: {path} does not exist")
    if path.is_dir():
        rows = _read_dataset_dir(path, what)
        where = "row"
    elif path.suffix == ".jsonl":
        rows = _read_jsonl(path, what)
        where = "line"
    elif path.suffix == ".json":
        rows = _read_json(path, what)
        where = "entry"
    elif path.suffix == ".parquet":
        rows = _read_parquet(path, what)
        where = "row"
    else:
        supported = ", ".join(SUPPORTED_SUFFIXES)
        raise DataError(
            f"{what}: {path} has unsupported suffix {path.suffix!r}; "
            f"supported: {supported}, or a Hugging Face dataset directory (save_to_disk)"
        )
    for n, row in rows:
        location = f"{where} {n} of {path}"
        yield location, _to_task(row, f"{path.stem}-{n}", what, location)


def _read_jsonl(path: Path, what: str) -> Iterator[tuple[int, Any]]:
    # split("\n"), not splitlines(): a JSON string may hold a raw U+2028, which is no line end.
    for line_no, line in enumerate(_read_text(path, what).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{what}: line {line_no} of {path} is not valid JSON ({e.msg} at column {e.colno})"
            ) from e
        except (ValueError, RecursionError) as e:  # a 4300-digit integer, nesting past the limit
            raise DataError(f"{what}: line {line_no} of {path} is not usable JSON ({e})") from e


def _read_json(path: Path, what: str) -> Iterator[tuple[int, Any]]:
    try:
        rows = json.loads(_read_text(path, what))
    except json.JSONDecodeError as e:
        raise DataError(
            f"{what}: {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from e
    except (ValueError, RecursionError) as e:
        raise DataError(f"{what}: {path} is not usable JSON ({e})") from e
    if not isinstance(rows, list):
        raise DataError(
            f"{what}: {path} must hold a JSON list of task objects, got {type(rows).__name__}"
        )
    yield from enumerate(rows, start=1)


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark is not data
    except UnicodeDecodeError as e:
        raise DataError(f"{what}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{what}: cannot read {path}: {e.strerror or e}") from e


def _read_parquet(path: Path, what: str) -> Iterator[tuple[int, Any]]:
    try:
        parquet = importlib.import_module("pyarrow.parquet")
    except ImportError as e:
        raise DataError(f"{what}: reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        rows = parquet.read_table(path).to_pylist()
    except (OSError, ValueError) as e:
        raise DataError(f"{what}: cannot read parquet file {path}: {e}") from e
    yield from enumerate(rows, start=1)


def _read_dataset_dir(path: Path, what: str) -> Iterator[tuple[int, Any]]:
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as e:
        raise DataError(
            f"{what}: {path} is a directory; reading it as a Hugging Face dataset needs "
            "datasets: pip install datasets"
        ) from e
    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"{what}: {path} is not a dataset saved with save_to_disk: {e}") from e
    if isinstance(dataset, Mapping):  # a DatasetDict: one dataset per split
        splits = sorted(dataset)
        if len(splits) != 1:
            raise DataError(
                f"{what}: {path} holds the splits {splits}; point {what} at one split's "
                f"directory, e.g. {path / splits[0]}"
            )
        dataset = dataset[splits[0]]
    yield from enumerate(dataset, start=1)


def _from_generator(spec: Mapping[str, Any], what: str) -> Iterator[tuple[str, Task]]:
    target = spec.get("generator")
    if not isinstance(target, str):
        raise DataError(
            f"{what}: a mapping must be a generator spec {{generator: 'module.path:function', "
            f"...kwargs}}, got keys {sorted(spec)}"
        )
    fn = _import_callable(target, what)
    kwargs = {k: v for k, v in spec.items() if k != "generator"}
    try:
        produced = fn(**kwargs)
    except TypeError as e:
        # The names only: a value may be a secret (an API key passed through).
        raise DataError(
            f"{what}: generator {target!r} rejected kwargs {sorted(kwargs)}: {e}"
        ) from e
    if not isinstance(produced, Iterable) or isinstance(produced, str | bytes | Mapping):
        raise DataError(
            f"{what}: generator {target!r} returned {type(produced).__name__}; "
            "it must return an iterable of Task or dicts"
        )
    for i, item in enumerate(produced):
        location = f"item {i} of generator {target!r}"
        if isinstance(item, Task):
            yield location, item
        elif isinstance(item, Mapping):
            yield location, _to_task(dict(item), f"gen-{i}", what, location)
        else:
            raise DataError(
                f"{what}: {location} is a {type(item).__name__}; expected a Task or a dict"
            )


def _import_callable(target: str, what: str) -> Any:
    try:
        obj = import_object(target, what=f"{what}: generator")
    except UsageError as e:
        raise DataError(str(e)) from e
    if not callable(obj):
        raise DataError(f"{what}: generator {target!r} is a {type(obj).__name__}, not callable")
    return obj


def _to_task(row: Any, default_id: str, what: str, location: str) -> Task:
    if not isinstance(row, dict):
        raise DataError(f"{what}: {location} is a {type(row).__name__}; expected an object")
    if "id" in row:
        raw_id = row["id"]
        if raw_id is None or isinstance(raw_id, dict | list):
            raise DataError(
                f"{what}: {location} has id {raw_id!r}; an id must be a string or a number"
            )
        task_id = str(raw_id)
    else:
        task_id = default_id
    if row.keys() == {"id", "data"} and isinstance(row["data"], dict):
        data = row["data"]
    else:
        data = {k: v for k, v in row.items() if k != "id"}
    try:
        return Task(id=task_id, data=data)
    except ValidationError as e:
        raise DataError(f"{what}: {location} is not a valid task: {e}") from e


def _unique(located: Iterable[tuple[str, Task]], what: str) -> list[Task]:
    first_seen: dict[str, str] = {}
    tasks: list[Task] = []
    for location, task in located:
        if task.id in first_seen:
            raise DataError(
                f"{what}: duplicate task id {task.id!r} at {first_seen[task.id]} and at "
                f"{location}; task ids must be unique"
            )
        first_seen[task.id] = location
        tasks.append(task)
    return tasks


class TaskSampler:
    """Endless, reproducible stream of tasks: shuffled per epoch from a seed; resumable.

    The order of epoch `e` is a permutation drawn from `random.Random(seed * 1_000_003 + e)`
    (file order when `shuffle=False`), so it depends on nothing drawn before. The state is
    `(epoch, index)`, the position of the next task; `state_dict()` saved after any draw and
    loaded into a sampler over the same tasks continues with exactly the same tasks.
    """

    def __init__(self, tasks: Sequence[Task], *, seed: int, shuffle: bool = True) -> None:
        if not tasks:
            raise DataError("TaskSampler needs at least one task, got an empty dataset")
        self._tasks = tuple(tasks)
        self._seed = seed
        self._shuffle = shuffle
        # What fixes the order: the tasks' ids, the seed and shuffling (saved with the position).
        digest = hashlib.blake2b(f"{seed}|{shuffle}".encode(), digest_size=8)
        for task in self._tasks:
            digest.update(b"\0" + task.id.encode())
        self._fingerprint = int.from_bytes(digest.digest(), "big") >> 1  # a non-negative int
        self._epoch = 0
        self._index = 0
        self._consumed = 0
        self._order = self._order_of(0)

    @property
    def epoch(self) -> int:
        """Epochs completed: the epoch the next task comes from."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Tasks handed out in total, over all epochs."""
        return self._consumed

    def next(self) -> Task:
        """The next task; starts a new epoch (a new permutation) after the last of one."""
        task = self._tasks[self._order[self._index]]
        self._index += 1
        self._consumed += 1
        if self._index == len(self._tasks):
            self._epoch += 1
            self._index = 0
            self._order = self._order_of(self._epoch)
        return task

    def take(self, n: int) -> list[Task]:
        """The next `n` tasks, crossing epoch boundaries as needed."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        """The position of the next task, JSON-able: `{"epoch", "index", "consumed"}`, and
        `"order"`, a fingerprint of the tasks, seed and shuffling it is a position in."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "consumed": self._consumed,
            "order": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a `state_dict()` of a sampler over the same tasks, seed and shuffle."""
        values: dict[str, int] = {}
        for key in ("epoch", "index", "consumed"):
            value = state.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(
                    f"sampler state {key!r} must be an integer >= 0, got {value!r} in {dict(state)}"
                )
            values[key] = value
        order = state.get("order")  # absent from states saved before it was recorded
        if order is not None and order != self._fingerprint:
            raise DataError(
                "the train tasks or trainer.seed differ from the run's checkpoint: "
                "resuming would train some tasks twice and skip others; resume with the same "
                "data and seed (or start a new run)"
            )
        if values["index"] >= len(self._tasks):
            raise DataError(
                f"sampler state index {values['index']} is past the {len(self._tasks)} tasks of "
                "this dataset; the dataset changed since the state was saved"
            )
        self._epoch = values["epoch"]
        self._index = values["index"]
        self._consumed = values["consumed"]
        self._order = self._order_of(self._epoch)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self._tasks)))
        if self._shuffle:
            random.Random(self._seed * _EPOCH_SEED_STRIDE + epoch).shuffle(order)
        return order
