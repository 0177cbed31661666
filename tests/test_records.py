"""Rollout records: each record type as written and read back, rotation, the cut on resume, and
damaged files answered in one line naming the file and the line."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest

from unified.groups import GroupTicket
from unified.records import (
    EpisodeRecord,
    EvalRecord,
    RecordError,
    RecordWriter,
    RunRecord,
    SaveRecord,
    StepRecord,
    StepTimeline,
    read_records,
    record_files,
    truncate_records,
)
from unified.types import Episode, EpisodeTiming, ModelOutput, Step, Task, Trajectory


def lines_of(path: Path) -> list[str]:
    return gzip.decompress(path.read_bytes()).decode().splitlines()


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))


class CharTokenizer:
    """Token i is the character chr(i): enough to check which text lands where."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def two_turn_episode(index: int, reward: float) -> Episode:
    """A chat of two model calls, the second's prompt extending the first call's prompt and
    completion with a tool result; its last token sampled by a newer version."""
    first = ModelOutput(
        text="calc",
        prompt_ids=ids("Q:"),
        completion_ids=ids("calc"),
        logprobs=[-0.5] * 4,
        finish_reason="stop",
        policy_version=3,
    )
    second = ModelOutput(
        text="=7",
        prompt_ids=ids("Q:calc[7]"),
        completion_ids=ids("=7"),
        logprobs=[-0.25, -0.125],
        finish_reason="stop",
        policy_version=3,
        token_versions=[3, 4],
    )
    steps = [Step(output=first, info={"tool_calls": 1}), Step(output=second, reward=reward)]
    return Episode(
        task_id="t1",
        rollout_index=index,
        trajectories=[Trajectory(steps=steps, reward=reward)],
        policy_version=3,
        timing=EpisodeTiming(
            started=10.5, ended=12.0, calls=[(10.6, 11.0), (11.5, 11.6, 11.8, 11.9)]
        ),
    )


async def write_one_of_each(run_dir: Path) -> RecordWriter:
    writer = RecordWriter(run_dir, every=2, eval_episodes=True, max_mb=1)
    writer.tokenizer = CharTokenizer()
    writer.run_started(0, "async", "local")
    task = Task(id="t1", data={"numbers": [3, 4]})
    ticket = GroupTicket(3, 4, "g000004-t1", "t1", dispatched=10.0, task=task)
    episodes = [two_turn_episode(0, 1.0), two_turn_episode(1, 0.0)]
    writer.group(5, ticket, "trained", 4, episodes, advantages={0: 0.5})
    timeline = StepTimeline()
    with timeline.span("wait"):
        pass
    with timeline.span("optim"):
        pass
    writer.step(5, timeline.take(), trained_at=4, synced_to=5)
    assert await writer.drain(30) == 4  # a checkpoint hands the step's records over
    writer.evaluated(5, 20.0, 21.0, 0.5, [(task, episodes[0], True)], version=5)
    writer.saved(5, 21.0, 22.0)
    assert await writer.drain(30) == 7
    return writer


async def test_the_writer_gets_records_by_the_second_or_by_the_episodes_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hand-off to the writer thread costs the loop; each episode waiting keeps objects
    alive for the garbage collector to walk: a step hands over only past either bound."""
    import unified.records as records

    monkeypatch.setattr(records, "FLUSH_EVERY_S", 3600.0)
    monkeypatch.setattr(records, "FLUSH_EPISODES", 4)
    writer = RecordWriter(tmp_path, every=1, eval_episodes=False, max_mb=1)
    ticket = GroupTicket(3, 4, "g000004-t1", "t1", dispatched=10.0)
    for step in (1, 2):
        writer.group(step, ticket, "trained", 0, [two_turn_episode(0, 1.0)] * 2, {0: 1.0})
        writer.step(step, [], trained_at=0, synced_to=None)
        assert len(writer._pending) == step - 1, "two episodes wait; four go to the writer"
    monkeypatch.setattr(records, "FLUSH_EVERY_S", 0.0)
    writer.step(3, [], trained_at=0, synced_to=None)
    assert await writer.drain(30) == 7
    await writer.close(30)


async def test_each_record_type_reads_back_as_written(tmp_path: Path) -> None:
    writer = await write_one_of_each(tmp_path)
    await writer.close(30)
    records, warnings = read_records(tmp_path)
    assert warnings == []
    assert [type(r) for r in records] == [
        RunRecord,
        EpisodeRecord,
        EpisodeRecord,
        StepRecord,
        EvalRecord,
        EpisodeRecord,
        SaveRecord,
    ]
    run, kept, left_out, step, evaluation, eval_episode, save = records
    assert isinstance(run, RunRecord) and (run.step, run.mode, run.backend) == (0, "async", "local")

    assert isinstance(kept, EpisodeRecord) and isinstance(left_out, EpisodeRecord)
    assert (kept.outcome, kept.trained, kept.advantage) == ("trained", True, 0.5)
    assert (left_out.trained, left_out.advantage) == (False, None), "not kept: no loss on it"
    assert kept.task == {"numbers": [3, 4]} and kept.step == 5 and kept.trainer_version == 4
    first, second = kept.turns
    assert (first.prompt, first.pieces, first.info) == ("Q:", list("calc"), {"tool_calls": 1})
    assert second.prompt == "[7]", "only what is new at the second call: the tool's result"
    assert (second.pieces, second.versions) == (["=", "7"], [3, 4]), "each token's version"
    assert second.logprobs == [-0.25, -0.125] and second.ids == ids("=7")
    assert kept.timing is not None
    assert (kept.timing.dispatched, kept.timing.started, kept.timing.ended) == (10.0, 10.5, 12.0)
    assert kept.timing.calls == [(10.6, 11.0), (11.5, 11.6, 11.8, 11.9)]

    assert isinstance(step, StepRecord) and (step.trained_at, step.synced_to) == (4, 5)
    assert [kind for kind, _, _ in step.spans] == ["wait", "optim"]
    assert all(start <= end for _, start, end in step.spans)
    assert isinstance(evaluation, EvalRecord) and (evaluation.accuracy, evaluation.episodes) == (
        0.5,
        1,
    )
    assert isinstance(eval_episode, EpisodeRecord)
    assert (eval_episode.outcome, eval_episode.correct, eval_episode.trained) == (
        "eval",
        True,
        False,
    )
    assert isinstance(save, SaveRecord) and (save.step, save.start, save.end) == (5, 21.0, 22.0)


async def test_only_every_nth_group_is_recorded(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path, every=4, eval_episodes=False, max_mb=1)
    assert [seq for seq in range(10) if writer.records_group(seq)] == [0, 4, 8]
    assert not RecordWriter(tmp_path, every=0, eval_episodes=False, max_mb=1).records_group(0)
    await writer.close(30)


async def test_files_rotate_and_the_oldest_go_past_the_bound(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path, every=1, eval_episodes=False, max_mb=0.02)  # 20 KiB
    writer.tokenizer = CharTokenizer()
    ticket = GroupTicket(0, 0, "g000000-t1", "t1", task=Task(id="t1"))
    for _ in range(60):  # a write each (a run writes once a step)
        writer.group(1, ticket, "filtered", 0, [two_turn_episode(0, 0.0)])
        lines = await writer.drain(30)
    await writer.close(30)
    assert lines == 60
    files = record_files(tmp_path / "records")
    assert len(files) > 1, "it rotated"
    total = sum(path.stat().st_size for _, path in files)
    assert total <= 0.02 * 2**20, "the oldest files went"
    kept = sum(len(lines_of(path)) for _, path in files)
    assert files[0][0] + kept == 60, "each file is named by the number of its first line"


async def test_resume_cuts_the_lines_after_the_checkpoint_and_a_torn_one(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path, every=1, eval_episodes=False, max_mb=0.02)
    writer.tokenizer = CharTokenizer()
    ticket = GroupTicket(0, 0, "g000000-t1", "t1", task=Task(id="t1"))
    for _ in range(40):
        writer.group(1, ticket, "filtered", 0, [two_turn_episode(0, 0.0)])
        await writer.drain(30)
    await writer.close(30)
    newest = record_files(tmp_path / "records")[-1][1]
    with newest.open("ab") as f:
        f.write(gzip.compress(b'{"type": "save", "step": 1, "start": 1, "end": 2}\n')[:15])
    files_before = record_files(tmp_path / "records")
    assert truncate_records(tmp_path, 25) == 25
    records, warnings = read_records(tmp_path)
    assert len(records) == 25 - files_before[0][0] and warnings == []
    assert all(first < 25 for first, _ in record_files(tmp_path / "records"))
    # a writer that goes on numbers its next file from there
    again = RecordWriter(tmp_path, every=1, eval_episodes=False, max_mb=0.02, lines=25)
    again.tokenizer = CharTokenizer()
    again.group(2, ticket, "filtered", 0, [two_turn_episode(0, 0.0)])
    assert await again.drain(30) == 26
    await again.close(30)
    assert truncate_records(tmp_path, 0) == 0 and record_files(tmp_path / "records") == []


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("{not json", "not JSON"),
        ('{"type": "gossip"}', "record type 'gossip' is none of run, episode, step"),
        ('{"type": "save", "step": "x", "start": 1, "end": 2}', "save record: step"),
        ('{"type": "run", "started": 1, "step": 0, "mode": "a", "backend": "b", "x": 1}', "x"),
    ],
)
async def test_a_damaged_record_is_one_error_naming_file_and_line(
    tmp_path: Path, line: str, said: str
) -> None:
    await (await write_one_of_each(tmp_path)).close(30)
    (_, path), *_ = record_files(tmp_path / "records")
    lines = lines_of(path)
    lines[2] = line
    write_lines(path, lines)
    with pytest.raises(RecordError) as raised:
        read_records(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{path}:3: ") and said in message and "\n" not in message


async def test_a_torn_end_is_left_out_with_a_warning_but_a_cut_older_file_is_an_error(
    tmp_path: Path,
) -> None:
    await (await write_one_of_each(tmp_path)).close(30)
    (_, path), *_ = record_files(tmp_path / "records")
    data = path.read_bytes()
    path.write_bytes(data[:-10])  # the last write (the evaluation and the save), cut by a kill
    records, warnings = read_records(tmp_path)
    assert len(records) == 4 and "torn" in warnings[0], "the step's write is whole"
    newer = tmp_path / "records" / "records-000000007.jsonl.gz"
    write_lines(newer, [json.dumps({"type": "save", "step": 6, "start": 1, "end": 2})])
    with pytest.raises(RecordError, match="cut short, and it is not the newest file"):
        read_records(tmp_path)


def test_the_timeline_sums_its_spans_by_kind() -> None:
    timeline = StepTimeline()
    for kind in ("wait", "forward", "wait"):
        with timeline.span(kind):  # type: ignore[arg-type]
            asyncio.run(asyncio.sleep(0.01))
    assert timeline.seconds("wait") >= 0.02 and timeline.seconds("sync") == 0
    assert [k for k, _, _ in timeline.take()] == ["wait", "forward", "wait"]
    assert timeline.spans == []
