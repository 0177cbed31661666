"""Countdown: reachable disjoint tasks, a safe exact reward, warm-start data, baselines."""

from __future__ import annotations

import itertools
import json
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from examples.countdown import (
    CountdownWorkflow,
    countdown_reward,
    make_tasks,
    parse_expression,
    prompt,
    random_expression,
    split_of,
    warmstart_examples,
    write_jsonl,
)
from examples.countdown.baselines import (
    baselines,
    best_fixed_pattern,
    best_fixed_patterns,
    best_pattern_by_target_band,
    main,
)
from examples.countdown.expressions import random_tree, render
from examples.countdown.prepare import (
    RECIPE_FILE,
    TOOL_WARMSTART_RECIPE,
    WarmStartRecipe,
    is_built,
)
from examples.countdown.warmstart import TARGET_SUFFIX
from unified.data import load_tasks
from unified.errors import UsageError
from unified.protocol import RolloutEngine
from unified.rollout import resolve_workflow
from unified.types import ModelOutput, Task

DATA = {"numbers": [3, 4, 6], "target": 8}


def solve(numbers: list[int], target: int) -> str | None:
    """A solution by brute force over every pair combination, or None: independent of the code."""

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, ea), (b, eb) = items[i], items[j]
            rest = [item for k, item in enumerate(items) if k not in (i, j)]
            combined = [(a + b, f"({ea}+{eb})"), (a - b, f"({ea}-{eb})"), (a * b, f"({ea}*{eb})")]
            if b != 0:
                combined.append((a / b, f"({ea}/{eb})"))
            for item in combined:
                found = search([*rest, item])
                if found is not None:
                    return found
        return None

    return search([(Fraction(x), str(x)) for x in numbers])


def problem_keys(tasks: list[Task]) -> set[tuple[tuple[int, ...], int]]:
    return {(tuple(sorted(t.data["numbers"])), t.data["target"]) for t in tasks}


# --- tasks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("numbers", [2, 3, 4])
def test_every_task_has_a_solution_the_reward_accepts(numbers: int) -> None:
    tasks = make_tasks(60, numbers=numbers)
    for task in tasks:
        solution = solve(task.data["numbers"], task.data["target"])
        assert solution is not None, f"{task.id} {task.data} has no solution"
        assert countdown_reward(solution, task.data) == (1.0, True), f"{solution} for {task.data}"


def test_tasks_respect_the_difficulty_settings() -> None:
    tasks = make_tasks(200, split="eval", numbers=4, max_number=9, max_target=50)
    for task in tasks:
        numbers, target = task.data["numbers"], task.data["target"]
        assert len(numbers) == 4 and all(1 <= x <= 9 for x in numbers), task.data
        assert isinstance(target, int) and 1 <= target <= 50, task.data
    assert [t.id for t in tasks] == [f"eval-{i}" for i in range(200)]


def test_make_tasks_is_deterministic_for_a_seed() -> None:
    first, again = make_tasks(100, seed=3), make_tasks(100, seed=3)
    assert [t.data for t in first] == [t.data for t in again], "same seed gave different tasks"
    other = make_tasks(100, seed=4)
    assert [t.data for t in first] != [t.data for t in other], "seeds 3 and 4 gave the same tasks"


def test_train_and_eval_splits_are_disjoint() -> None:
    train = problem_keys(make_tasks(3000, split="train"))
    evaluation = problem_keys(make_tasks(300, split="eval"))
    assert not train & evaluation, f"problems in both splits: {sorted(train & evaluation)[:5]}"


def test_split_is_a_property_of_the_problem_not_of_its_order() -> None:
    for task in make_tasks(50, split="eval"):
        numbers, target = task.data["numbers"], task.data["target"]
        assert split_of(numbers, target) == "eval"
        assert split_of(list(reversed(numbers)), target) == "eval", "order changed the split"


def test_tasks_within_a_split_are_distinct() -> None:
    tasks = make_tasks(500, split="eval")
    assert len(problem_keys(tasks)) == 500, "a problem appears twice in one split"


def test_make_tasks_works_as_a_data_generator_spec() -> None:
    spec = {"generator": "examples.countdown.tasks:make_tasks", "n": 20, "split": "eval"}
    tasks = load_tasks(spec, what="data.eval")
    assert [t.data for t in tasks] == [t.data for t in make_tasks(20, split="eval")]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"split": "test"},
        {"numbers": 1},
        {"numbers": 7},
        {"max_number": 0},
        {"max_target": 0},
        {"n": -1},
    ],
)
def test_make_tasks_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {"n": 5, **kwargs}
    with pytest.raises(ValueError):
        make_tasks(**arguments)


def test_make_tasks_says_when_the_split_has_too_few_problems() -> None:
    with pytest.raises(ValueError, match="distinct eval problems"):
        make_tasks(100, split="eval", numbers=2, max_number=3)


def test_prompt_is_short_ascii_numbers_then_target() -> None:
    assert prompt({"numbers": [3, 7, 12], "target": 33}) == "3 7 12 -> 33"
    for task in make_tasks(300):
        text = prompt(task.data)
        assert text.isascii() and len(text) <= 40, text


# --- reward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["6/(3/4)", "(6*4)/3", " 6 / ( 3 / 4 ) ", "6/(3/4)\n= 8, done"])
def test_reward_accepts_a_correct_answer(answer: str) -> None:
    assert countdown_reward(answer, DATA) == (1.0, True)


def test_reward_gives_format_reward_for_a_valid_answer_that_misses() -> None:
    assert countdown_reward("3+4+6", DATA) == (0.1, False)
    assert countdown_reward("3+4+6", DATA, format_reward=0.25) == (0.25, False)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ("6+6-4", "reuses 6, skips 3"),
        ("6/3*4*3", "uses 3 twice"),
        ("6+2", "misses 3 and 4"),
        ("6*4/3/1", "adds a number"),
        ("5+4+6", "uses 5 instead of 3"),
        ("34-6/... ", "not an expression"),
        ("34/6+0", "glues 3 and 4 together"),
    ],
)
def test_reward_rejects_answers_that_misuse_the_numbers(answer: str, why: str) -> None:
    assert countdown_reward(answer, DATA) == (0.0, False), why


def test_reward_counts_repeated_numbers_as_a_multiset() -> None:
    data = {"numbers": [5, 5, 2], "target": 23}
    assert countdown_reward("5*5-2", data) == (1.0, True)
    assert countdown_reward("5*5-2-5", data) == (0.0, False), "a third 5 was accepted"
    assert countdown_reward("5*2+2", data) == (0.0, False), "one 5 and two 2s were accepted"


@pytest.mark.parametrize(
    "answer",
    [
        "__import__('os').system('x')",
        "2**99999999",
        "9**9**9**9",
        "(1)*" * 10000,
        "1/0",
        "6/(4-4)+3",
        "[1,2]",
        "lambda: 1",
        "1e9",
        "-3+10",
        "3+-4*6",
        "True+1",
        "6//3+4",
        "6%3+4",
        "3(4)+6",
        "(3,4,6)",
        "",
        "   ",
        "9" * 100_000,
        "(" * 60 + "3+4+6" + ")" * 60,
        "\u0663+\u0664+\u0666",  # Arabic-Indic digits 3, 4, 6
        "\uff13+\uff14+\uff16",  # fullwidth digits 3, 4, 6
        "3+4+6\x00",
    ],
)
def test_reward_rejects_malformed_or_malicious_answers_without_raising(answer: str) -> None:
    assert countdown_reward(answer, {"numbers": [3, 4, 6, 0, 1, 2, 9], "target": 8}) == (
        0.0,
        False,
    )


def test_reward_scores_zero_for_division_by_zero_with_the_right_numbers() -> None:
    assert countdown_reward("5/(2-2)", {"numbers": [2, 2, 5], "target": 1}) == (0.0, False)


@given(st.text(max_size=200))
def test_reward_never_raises_on_any_text(text: str) -> None:
    reward, correct = countdown_reward(text, DATA)
    assert (reward, correct) in {(0.0, False), (0.1, False), (1.0, True)}


@given(st.text(alphabet="0123456789+-*/() ", max_size=80))
def test_reward_never_raises_on_arithmetic_looking_text(text: str) -> None:
    reward, _ = countdown_reward(text, {"numbers": [1, 2, 3], "target": 6})
    assert reward in {0.0, 0.1, 1.0}


def test_reward_says_when_the_task_data_is_malformed() -> None:
    with pytest.raises(ValueError, match="numbers"):
        countdown_reward("1+2", {"numbers": "1 2", "target": 3})


# --- expressions and warm start ----------------------------------------------------------------


@given(
    st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=6),
    st.integers(min_value=0, max_value=2**32),
)
def test_random_expression_uses_each_number_once_and_reads_back_its_value(
    numbers: list[int], seed: int
) -> None:
    expr, value = random_tree(numbers, random.Random(seed))
    text = render(expr)
    assert " " not in text, text
    assert parse_expression(text, numbers) == value, f"{text} over {numbers} is not {value}"


@given(st.lists(st.integers(min_value=1, max_value=20), min_size=2, max_size=6), st.integers())
def test_random_expression_is_always_a_valid_answer(numbers: list[int], seed: int) -> None:
    text = random_expression(numbers, random.Random(seed))
    assert parse_expression(text, numbers) is not None, f"{text} over {numbers}"


def test_warmstart_examples_pair_train_prompts_with_valid_expressions() -> None:
    examples = warmstart_examples(300, seed=1)
    assert len(examples) == 300
    for example in examples:
        user, assistant = example["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        head, target = user["content"].split(" -> ")
        numbers = [int(x) for x in head.split()]
        assert split_of(numbers, int(target)) == "train", f"eval prompt {user['content']}"
        assert parse_expression(assistant["content"], numbers) is not None, example
        assert len(assistant["content"]) <= 20, assistant["content"]


def test_warmstart_target_examples_ask_for_the_target_and_the_rest_stay_expressions() -> None:
    examples = warmstart_examples(400, seed=1, target_share=0.25)
    asking = 0
    for example in examples:
        user, assistant = (m["content"] for m in example["messages"])
        head, target = user.removesuffix(TARGET_SUFFIX).split(" -> ")
        numbers = [int(x) for x in head.split()]
        assert split_of(numbers, int(target)) == "train", f"eval prompt {user}"
        if user.endswith(TARGET_SUFFIX):
            asking += 1
            assert assistant == target, example  # the target back, never an expression
        else:
            assert parse_expression(assistant, numbers) is not None, example
    assert 60 <= asking <= 140, asking  # about a quarter
    with pytest.raises(ValueError, match="target_share"):
        warmstart_examples(5, target_share=1.0)


def test_warmstart_examples_are_deterministic_for_a_seed() -> None:
    assert warmstart_examples(50, seed=2) == warmstart_examples(50, seed=2)
    assert warmstart_examples(50, seed=2) != warmstart_examples(50, seed=3)


def test_the_tool_warm_start_is_rebuilt_when_its_base_recipe_changes(tmp_path: Path) -> None:
    """Its base is named by a provider path that never changes; the base's recipe is the key."""
    built = TOOL_WARMSTART_RECIPE.model_dump()
    (tmp_path / RECIPE_FILE).write_text(json.dumps(built))
    assert is_built(tmp_path, TOOL_WARMSTART_RECIPE)
    older_base = TOOL_WARMSTART_RECIPE.model_copy(update={"base": WarmStartRecipe(steps=400)})
    assert not is_built(tmp_path, older_base)
    (tmp_path / RECIPE_FILE).write_text(json.dumps({k: v for k, v in built.items() if k != "base"}))
    assert not is_built(tmp_path, TOOL_WARMSTART_RECIPE), "a cache from before the field"


def test_write_jsonl_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sft" / "countdown.jsonl"
    write_jsonl(path, [{"old": True}])
    examples = warmstart_examples(5)
    write_jsonl(path, examples)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == examples
    assert [p.name for p in path.parent.iterdir()] == ["countdown.jsonl"]


# --- baselines ---------------------------------------------------------------------------------


def test_baselines_are_rates_and_random_expressions_rarely_hit() -> None:
    figures = baselines(make_tasks(200, split="eval"), samples=5)
    assert set(figures) == {"random_valid_expression", "best_fixed_pattern"}
    assert all(0.0 <= rate <= 1.0 for rate in figures.values()), figures
    assert figures["random_valid_expression"] < 0.5, figures


def test_baselines_with_more_tries_hit_more_and_one_try_is_the_single_baseline() -> None:
    tasks = make_tasks(200, split="eval")
    one, three = baselines(tasks, samples=5), baselines(tasks, samples=5, attempts=3)
    assert one["best_fixed_pattern"] == best_fixed_pattern(tasks)[1]
    for name in one:
        assert three[name] > one[name], (name, one, three)
    patterns, rate = best_fixed_patterns(tasks, 3)
    assert len(set(patterns)) == 3 and rate == three["best_fixed_pattern"]


def test_best_fixed_pattern_finds_a_pattern_every_task_follows() -> None:
    rng = random.Random(0)
    tasks = []
    for i in range(30):
        a, b, c = (rng.randint(1, 9) for _ in range(3))
        tasks.append(Task(id=str(i), data={"numbers": [a, b, c], "target": (a - c) * b}))
    name, rate = best_fixed_pattern(tasks)
    assert rate == 1.0, f"{name} hit only {rate}"
    assert name.startswith("prompt:"), name


def test_best_pattern_by_target_band_gives_each_band_its_own_pattern() -> None:
    rng = random.Random(1)
    tasks = []
    for i in range(40):
        if i % 2:  # small numbers, summed: targets below 10
            a, b, c = (rng.randint(1, 3) for _ in range(3))
            target = a + b + c
        else:  # large numbers, multiplied: targets of 1000 and more
            a, b, c = (rng.randint(10, 20) for _ in range(3))
            target = a * b * c
        tasks.append(Task(id=str(i), data={"numbers": [a, b, c], "target": target}))
    _, single = best_fixed_pattern(tasks)
    assert single < 1.0
    assert best_pattern_by_target_band(tasks, width=1000) == 1.0
    with pytest.raises(ValueError, match="width"):
        best_pattern_by_target_band(tasks, width=0)


def test_baselines_command_prints_and_writes_the_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--n", "20", "--samples", "2", "--json", str(tmp_path / "b.json")])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "b.json").read_text(encoding="utf-8"))
    assert set(printed) == {
        "random_valid_expression",
        "best_fixed_pattern",
        "best_fixed_pattern_name",
        "best_pattern_by_target_band",
    }


# --- workflow ----------------------------------------------------------------------------------


class ReplyEngine(RolloutEngine):
    """Answers every chat with one fixed reply."""

    def __init__(self, reply: str) -> None:
        self.reply = reply
        self.seen: list[list[dict[str, Any]]] = []

    @property
    def tokenizer(self) -> Any:
        raise NotImplementedError

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ModelOutput:
        self.seen.append(messages)
        return await self.complete([], **sampling)

    async def complete(self, prompt_ids: list[int], **sampling: Any) -> ModelOutput:
        return ModelOutput(
            text=self.reply,
            prompt_ids=prompt_ids,
            completion_ids=[0],
            logprobs=[-1.0],
            finish_reason="stop",
            policy_version=0,
        )


def test_workflow_messages_hold_the_prompt() -> None:
    task = Task(id="t", data={"numbers": [3, 7, 12], "target": 33})
    assert CountdownWorkflow().messages(task) == [{"role": "user", "content": "3 7 12 -> 33"}]


@pytest.mark.parametrize(
    ("reply", "reward", "correct"),
    # 3+7+12 = 22 misses 33 by a third: format 0.1 + closeness 0.45 * (1 - 1/3).
    [("3*7+12", 1.0, True), ("3+7+12", 0.4, False), ("33", 0.0, False)],
)
async def test_workflow_run_scores_the_reply(reply: str, reward: float, correct: bool) -> None:
    task = Task(id="t", data={"numbers": [3, 7, 12], "target": 33})
    engine = ReplyEngine(reply)
    trajectory = await CountdownWorkflow().run(task, engine)
    assert trajectory.reward == pytest.approx(reward)
    assert trajectory.steps[0].info == {"correct": correct}
    assert engine.seen == [[{"role": "user", "content": "3 7 12 -> 33"}]]


async def test_workflow_args_set_the_credits_of_one_run() -> None:
    task = Task(id="t", data={"numbers": [3, 7, 12], "target": 33})
    workflow = resolve_workflow(
        "examples.countdown.workflow:CountdownWorkflow", {"closeness_reward": 0.3}
    )
    trajectory = await workflow(task, ReplyEngine("3+7+12"))
    assert trajectory.reward == pytest.approx(0.1 + 0.3 * (1 - 11 / 33))
    assert CountdownWorkflow.closeness_reward == 0.45  # the class default is untouched


def test_workflow_args_outside_the_reward_range_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match="closeness_reward must be in \\[0, 1\\)"):
        resolve_workflow("examples.countdown.workflow:CountdownWorkflow", {"closeness_reward": 3})


def test_warmstart_in_order_keeps_the_prompt_order_of_the_numbers() -> None:
    for example in warmstart_examples(50, seed=3, in_order=1.0):
        user, assistant = (m["content"] for m in example["messages"])
        numbers = user.split(" -> ")[0].split()
        assert re.findall(r"\d+", assistant) == numbers, (user, assistant)


def test_closeness_reward_pays_more_for_a_nearer_miss() -> None:
    data = {"numbers": [3, 5, 7], "target": 22}
    near, _ = countdown_reward("3*5+7", data, format_reward=0.1, closeness_reward=0.3)  # 22: hit
    close, _ = countdown_reward("3+5*7", data, format_reward=0.1, closeness_reward=0.3)  # 38
    far, _ = countdown_reward("3*5*7", data, format_reward=0.1, closeness_reward=0.3)  # 105
    assert near == 1.0 and 0.1 < close < 0.4 and far == 0.1


def test_closeness_reward_credits_integer_misses_only_and_floors_small_targets() -> None:
    data = {"numbers": [2, 3, 4], "target": 5}
    # 2/3+4 is 4.67, nearer 5 than any integer miss, but a fraction can never hit: format only.
    fraction, _ = countdown_reward("2/3+4", data, format_reward=0.1, closeness_reward=0.3)
    assert fraction == 0.1
    # 2+3+4 = 9 misses 5 by 4; small targets are measured against 10, not 5.
    integer, _ = countdown_reward("2+3+4", data, format_reward=0.1, closeness_reward=0.3)
    assert integer == pytest.approx(0.1 + 0.3 * (1 - 4 / 10))


def test_patterns_reads_a_runs_eval_answers_by_band_and_operators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    from examples.countdown import patterns

    def episode(index: int, target: int, pieces: list[str], correct: bool) -> dict[str, Any]:
        turn = {
            "prompt": "p",
            "prompt_tokens": 1,
            "ids": list(range(len(pieces))),
            "pieces": pieces,
            "logprobs": [0.0] * len(pieces),
            "versions": [0] * len(pieces),
            "finish": "stop",
        }
        return {
            "type": "episode",
            "step": 50,
            "group_id": f"g{index}",
            "task_id": f"eval-{index}",
            "task": {"numbers": [3, 7, 2], "target": target},
            "index": 0,
            "outcome": "eval",
            "trained": False,
            "status": "ok",
            "reward": 1.0 if correct else 0.1,
            "correct": correct,
            "policy_version": 50,
            "trainer_version": 50,
            "turns": [turn],
        }

    lines = [
        {"type": "eval", "step": 50, "start": 0.0, "end": 1.0, "accuracy": 0.5, "episodes": 2},
        episode(0, 8, ["3", "+", "7", "-", "2", "<|im_end|>"], True),
        episode(1, 30, ["3", "+", "7", "+", "2", "<|im_end|>"], False),
    ]
    (tmp_path / "records").mkdir()
    with gzip.open(tmp_path / "records" / "records-000000000.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))

    (seen,) = patterns.eval_patterns(tmp_path)
    assert (seen.step, seen.accuracy) == (50, 0.5)
    assert dict(seen.bands) == {"small": [1, 1], "middling": [0, 1]}
    assert seen.patterns == {"+-": 1, "++": 1}
    assert patterns.main([str(tmp_path)]) == 0
    assert "small 100% middling 0%  | +- 1, ++ 1" in capsys.readouterr().out
    assert patterns.main([str(tmp_path / "nothing")]) == 2
    not_countdown = episode(2, 8, ["x"], False) | {"task": {"question": "?"}}
    with gzip.open(tmp_path / "records" / "records-000000003.jsonl.gz", "wt") as f:
        f.write(json.dumps(not_countdown) + "\n")
    assert patterns.main([str(tmp_path)]) == 2
    assert "needs 'numbers'" in capsys.readouterr().err
    empty = tmp_path / "empty"
    (empty / "records").mkdir(parents=True)
    assert patterns.main([str(empty)]) == 2
    assert "recorded no evaluations" in capsys.readouterr().err
