"""Task loading (files, dataset directories, generators) and the resumable task sampler."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unified.data import TaskSampler, load_tasks
from unified.errors import DataError, UsageError
from unified.types import Task


def make_tasks(n: int = 3, target: int = 10) -> Iterator[dict[str, Any]]:
    """A generator referenced from configs as `tests.test_data:make_tasks`."""
    for i in range(n):
        yield {"numbers": [i, i + 1], "target": target}


def make_task_objects(n: int = 2) -> list[Task]:
    return [Task(id=f"obj-{i}", data={"i": i}) for i in range(n)]


NOT_CALLABLE = 42


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


class FakeDatasets(types.ModuleType):
    """Stands in for the `datasets` package: `load_from_disk` returns what was "saved"."""

    def __init__(self, saved: object) -> None:
        super().__init__("datasets")
        self.saved = saved

    def load_from_disk(self, path: str) -> object:
        return self.saved


def tasks_of(n: int) -> list[Task]:
    return [Task(id=f"t{i}", data={"i": i}) for i in range(n)]


# --- jsonl, json ---------------------------------------------------------------------------


def test_jsonl_ids_come_from_the_id_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [{"id": "a", "x": 1}, {"id": 7, "x": 2}])

    tasks = load_tasks(path)

    assert [t.id for t in tasks] == ["a", "7"], "ids must be str() of the id field"
    assert [t.data for t in tasks] == [{"x": 1}, {"x": 2}], "data must be the object minus id"


def test_jsonl_ids_default_to_stem_and_line_number(tmp_path: Path) -> None:
    path = tmp_path / "countdown.jsonl"
    path.write_text('{"x": 1}\n\n{"x": 2}\n', encoding="utf-8")

    tasks = load_tasks(str(path))

    assert [t.id for t in tasks] == ["countdown-1", "countdown-3"], (
        "a missing id must become <stem>-<line number>, blank lines skipped but counted"
    )


def test_jsonl_object_of_exactly_id_and_data_is_unwrapped(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "a", "data": {"q": 1}}, {"id": "b", "data": {"q": 2}, "extra": 3}],
    )

    a, b = load_tasks(path)

    assert a.data == {"q": 1}, "an {id, data} object must use data as Task.data"
    assert b.data == {"data": {"q": 2}, "extra": 3}, "any other object must keep all but id"


def test_malformed_jsonl_line_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"x": 1}\n{"x": \n', encoding="utf-8")

    with pytest.raises(DataError, match=r"line 2 of .*bad\.jsonl"):
        load_tasks(path)


def test_jsonl_line_that_is_not_an_object_is_rejected(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "list.jsonl", [{"x": 1}, [1, 2]])

    with pytest.raises(DataError, match=r"line 2 .*list; expected an object"):
        load_tasks(path)


def test_empty_file_error_names_the_config_key(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n", encoding="utf-8")

    with pytest.raises(DataError, match=r"^data\.eval is empty: "):
        load_tasks(path, what="data.eval")


def test_missing_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl does not exist"):
        load_tasks(tmp_path / "nope.jsonl")


def test_unset_source_error_says_what_to_give() -> None:
    with pytest.raises(DataError, match=r"data\.train is not set; give a \.jsonl"):
        load_tasks(None)


def test_duplicate_ids_error_names_the_id_and_both_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a"}, {"id": "b"}, {"id": "a"}])

    with pytest.raises(DataError, match=r"duplicate task id 'a' at line 1 .* line 3"):
        load_tasks(path)


def test_unsupported_suffix_error_lists_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("a,b\n", encoding="utf-8")

    with pytest.raises(DataError, match=r"'\.csv'.*\.jsonl, \.json, \.parquet"):
        load_tasks(path)


def test_data_error_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        load_tasks(tmp_path / "missing.jsonl")


def test_json_list_follows_the_jsonl_rules(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([{"id": "a", "data": {"q": 1}}, {"q": 2}]), encoding="utf-8")

    tasks = load_tasks(path)

    assert [(t.id, t.data) for t in tasks] == [("a", {"q": 1}), ("tasks-2", {"q": 2})], (
        "a .json list must convert like jsonl, default ids numbered from 1"
    )


def test_json_file_that_is_not_a_list_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    path.write_text('{"id": "a"}', encoding="utf-8")

    with pytest.raises(DataError, match="must hold a JSON list"):
        load_tasks(path)


# --- parquet, dataset directories ------------------------------------------------------------


def test_parquet_rows_follow_the_jsonl_rules(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    parquet.write_table(pa.Table.from_pylist([{"id": "a", "n": 1}, {"id": "b", "n": 2}]), path)

    tasks = load_tasks(path)

    assert [(t.id, t.data) for t in tasks] == [("a", {"n": 1}), ("b", {"n": 2})], (
        "parquet rows must convert like jsonl objects"
    )


def test_parquet_without_pyarrow_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")

    with pytest.raises(DataError, match="pip install pyarrow"):
        load_tasks(path)


def test_dataset_directory_is_read_with_load_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets([{"q": 1}, {"id": "x", "q": 2}]))
    directory = tmp_path / "countdown"
    directory.mkdir()

    tasks = load_tasks(directory)

    assert [(t.id, t.data) for t in tasks] == [("countdown-1", {"q": 1}), ("x", {"q": 2})], (
        "dataset rows must convert like jsonl objects, default ids from the directory name"
    )


def test_dataset_directory_with_several_splits_asks_for_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {"train": [{"q": 1}], "test": [{"q": 2}]}
    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets(saved))

    with pytest.raises(DataError, match=r"splits \['test', 'train'\]"):
        load_tasks(tmp_path)


def test_dataset_directory_without_datasets_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)

    with pytest.raises(DataError, match="pip install datasets"):
        load_tasks(tmp_path)


# --- generators --------------------------------------------------------------------------


def test_generator_spec_passes_kwargs_and_numbers_ids() -> None:
    tasks = load_tasks({"generator": "tests.test_data:make_tasks", "n": 2, "target": 24})

    assert [t.id for t in tasks] == ["gen-0", "gen-1"], "generator dicts get ids gen-<i>"
    assert tasks[1].data == {"numbers": [1, 2], "target": 24}, "spec keys must reach the function"


def test_generator_may_return_tasks() -> None:
    tasks = load_tasks({"generator": "tests.test_data:make_task_objects"})

    assert [t.id for t in tasks] == ["obj-0", "obj-1"], "Task objects must pass through as they are"


def test_generator_bad_import_path_names_the_path() -> None:
    with pytest.raises(DataError, match="no_such_module_xyz:make"):
        load_tasks({"generator": "no_such_module_xyz:make"})


def test_generator_missing_function_names_the_path() -> None:
    with pytest.raises(DataError, match=r"tests\.test_data:nope"):
        load_tasks({"generator": "tests.test_data:nope"})


def test_generator_that_is_not_callable_is_rejected() -> None:
    with pytest.raises(DataError, match="not callable"):
        load_tasks({"generator": "tests.test_data:NOT_CALLABLE"})


def test_generator_unknown_kwarg_names_the_generator() -> None:
    with pytest.raises(DataError, match=r"generator 'tests.test_data:make_tasks'.*size"):
        load_tasks({"generator": "tests.test_data:make_tasks", "size": 3})


def test_mapping_without_generator_key_is_rejected() -> None:
    with pytest.raises(DataError, match="generator spec"):
        load_tasks({"path": "train.jsonl"})


def test_generator_yielding_nothing_is_empty() -> None:
    with pytest.raises(DataError, match=r"^data\.train is empty: generator"):
        load_tasks({"generator": "tests.test_data:make_tasks", "n": 0})


def test_importing_unified_data_loads_no_optional_readers() -> None:
    # A fresh interpreter: this process may already hold pyarrow from the parquet test.
    code = "import sys, unified.data; print(sorted({'pyarrow', 'datasets'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )

    assert out.stdout.strip() == "[]", "import unified.data must not import pyarrow or datasets"


# --- sampler --------------------------------------------------------------------------------


def test_sampler_hands_out_every_task_once_per_epoch() -> None:
    tasks = tasks_of(7)
    sampler = TaskSampler(tasks, seed=3)

    for epoch in range(3):
        drawn = sampler.take(7)

        assert sorted(t.id for t in drawn) == sorted(t.id for t in tasks), (
            f"epoch {epoch} must hold every task exactly once"
        )
    assert (sampler.epoch, sampler.consumed) == (3, 21), "3 full epochs of 7 tasks were drawn"


def test_sampler_with_the_same_seed_gives_the_same_order() -> None:
    first = [t.id for t in TaskSampler(tasks_of(20), seed=5).take(60)]
    second = [t.id for t in TaskSampler(tasks_of(20), seed=5).take(60)]

    assert first == second, "the same seed must give the same stream"


def test_sampler_epochs_are_different_permutations() -> None:
    sampler = TaskSampler(tasks_of(20), seed=0)

    epoch0, epoch1 = sampler.take(20), sampler.take(20)

    assert [t.id for t in epoch0] != [t.id for t in epoch1], "each epoch must be reshuffled"


def test_sampler_seeds_give_different_orders() -> None:
    a = [t.id for t in TaskSampler(tasks_of(20), seed=0).take(20)]
    b = [t.id for t in TaskSampler(tasks_of(20), seed=1).take(20)]

    assert a != b, "different seeds must give different orders"


def test_sampler_without_shuffle_keeps_file_order() -> None:
    sampler = TaskSampler(tasks_of(3), seed=9, shuffle=False)

    assert [t.id for t in sampler.take(7)] == ["t0", "t1", "t2"] * 2 + ["t0"], (
        "shuffle=False must repeat the file order"
    )


def test_sampler_rejects_an_empty_dataset() -> None:
    with pytest.raises(DataError, match="at least one task"):
        TaskSampler([], seed=0)


def test_sampler_state_dict_is_json_able() -> None:
    sampler = TaskSampler(tasks_of(4), seed=0)
    sampler.take(6)

    state = json.loads(json.dumps(sampler.state_dict()))

    order = state.pop("order")
    assert state == {"epoch": 1, "index": 2, "consumed": 6}, "state is the next task's position"
    assert isinstance(order, int) and order >= 0


def test_a_state_resumes_only_over_the_same_tasks_and_seed() -> None:
    """Another seed or dataset permutes differently: the same position would train some tasks
    twice and skip others."""
    sampler = TaskSampler(tasks_of(8), seed=0)
    sampler.take(3)
    state = sampler.state_dict()
    for other in (TaskSampler(tasks_of(8), seed=1), TaskSampler(tasks_of(9), seed=0)):
        with pytest.raises(DataError, match="differ from the run's checkpoint"):
            other.load_state_dict(state)
    same = TaskSampler(tasks_of(8), seed=0)
    same.load_state_dict(state)
    assert same.take(5) == sampler.take(5)
    legacy = {k: v for k, v in state.items() if k != "order"}  # saved before it was recorded
    TaskSampler(tasks_of(8), seed=1).load_state_dict(legacy)


def test_sampler_rejects_a_state_past_the_dataset() -> None:
    sampler = TaskSampler(tasks_of(4), seed=0)

    with pytest.raises(DataError, match="dataset changed"):
        sampler.load_state_dict({"epoch": 0, "index": 9, "consumed": 9})


@given(
    seed=st.integers(min_value=-(2**31), max_value=2**31),
    size=st.integers(min_value=1, max_value=12),
    split=st.integers(min_value=0, max_value=40),
    after=st.integers(min_value=1, max_value=40),
    shuffle=st.booleans(),
)
def test_sampler_resumed_from_state_dict_continues_identically(
    seed: int, size: int, split: int, after: int, shuffle: bool
) -> None:
    tasks = tasks_of(size)
    original = TaskSampler(tasks, seed=seed, shuffle=shuffle)
    original.take(split)
    state = json.loads(json.dumps(original.state_dict()))

    resumed = TaskSampler(tasks, seed=seed, shuffle=shuffle)
    resumed.load_state_dict(state)

    assert [t.id for t in resumed.take(after)] == [t.id for t in original.take(after)], (
        f"a sampler resumed after {split} draws must continue with the same tasks"
    )
    assert (resumed.epoch, resumed.consumed) == (original.epoch, original.consumed), (
        "epoch and consumed must carry over"
    )


@given(
    seed=st.integers(min_value=0, max_value=2**20),
    size=st.integers(min_value=1, max_value=12),
    epoch=st.integers(min_value=0, max_value=5),
)
def test_sampler_epoch_order_depends_only_on_seed_and_epoch(
    seed: int, size: int, epoch: int
) -> None:
    expected = list(range(size))
    random.Random(seed * 1_000_003 + epoch).shuffle(expected)
    sampler = TaskSampler(tasks_of(size), seed=seed)
    sampler.take(epoch * size)

    assert [t.id for t in sampler.take(size)] == [f"t{i}" for i in expected], (
        "epoch e must be the permutation of random.Random(seed * 1_000_003 + e)"
    )
