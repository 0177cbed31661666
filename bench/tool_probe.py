"""What RL starts from: the tool agent's warm start sampled at temperature 1, episodes by shape.

RL explores by sampling, so a warm start whose sampled calls are garbled, or whose checks score
no better than direct answers, gives RL no reason to keep the tool. This runs the countdown tool
agent on train problems with the train sampling settings and prints, for episodes that answer at
once and those that check first, how many there are and their mean reward, and the share of
sampled calls that were well-formed, with the malformed ones grouped by what broke. `--steps/--lr`
build a variant tool warm start (the default recipe otherwise) in `--into`, cached like the
default one; `--model` probes another model directory, `--checkpoint` a run's checkpoint (its
backend directory, loaded over the model), and `--set` passes config overrides (another
workflow, say). `--greedy` runs the eval problems at the eval settings instead, as the run's
evaluations do, and also prints which attempt hit, how often the second check repeated the
first, the shapes of the checked expressions (each of the task's numbers written `n`), and what
the first attempt was on the problems the numbers' sum solves (the sum, or a number miscopied).

    python -m bench.tool_probe --problems 512
    python -m bench.tool_probe --steps 100 --lr 2e-3 --into .cache/tool-warmstart-100-2e-3
    python -m bench.tool_probe --checkpoint runs/NAME/checkpoints/step_000100/backend
    python -m bench.tool_probe --greedy --problems 500 --checkpoint runs/NAME/checkpoints/step_N/...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.countdown.prepare import TOOL_WARMSTART_DIR, TOOL_WARMSTART_RECIPE, ensure_warmstart
from examples.countdown.reward import countdown_reward
from examples.countdown.tasks import make_tasks
from unified.config import load_config
from unified.evaluation import tool_call_metrics
from unified.protocol import create_backend
from unified.rollout import SamplingEngine, WorkflowDeadlines, resolve_workflow, run_episode
from unified.types import Episode, Task
from workflows.tool_calls import parse_tool_calls

CONFIG = "examples/countdown/local_tool_async.yaml"


async def probe(
    model: Path,
    problems: int,
    seed: int,
    overrides: Sequence[str] = (),
    checkpoint: Path | None = None,
    greedy: bool = False,
) -> tuple[dict[str, float], dict[str, tuple[int, str]], dict[str, Any]]:
    config = load_config(CONFIG, [f"model={model}", *overrides])
    backend = create_backend(config.backend)
    await backend.setup(config)
    try:
        if checkpoint is not None:
            await backend.load_checkpoint(checkpoint)
        sampler = backend.token_sampler()
        workflow = resolve_workflow(config.workflow)
        settings = config.sampling.eval if greedy else config.sampling.train
        deadlines = WorkflowDeadlines(config.trainer.workflow_timeout_s)
        if greedy:  # the problems a run evaluates on (the config's `data.eval`)
            tasks = make_tasks(problems, split="eval")
        else:
            tasks = make_tasks(problems, split="train", seed=seed)

        async def one(index: int) -> Episode:
            view = SamplingEngine(sampler, settings, seed + index)
            episode, _ = await run_episode(
                workflow, tasks[index], view,
                rollout_index=0, version=0, deadlines=deadlines,
            )  # fmt: skip
            return episode

        async with asyncio.TaskGroup() as group:
            running = [group.create_task(one(i)) for i in range(len(tasks))]
    finally:
        await backend.shutdown()
    episodes = [task.result() for task in running]
    shapes: dict[str, list[float]] = {"answer": [], "check": []}
    for episode in episodes:
        if episode.status == "ok":
            first = episode.trajectories[0].steps[0].info
            shapes["check" if first.get("tool_calls") else "answer"].append(episode.reward)
    calls = tool_call_metrics(episodes)
    result = {
        "episodes_answering": len(shapes["answer"]),
        "answer_mean_reward": statistics.fmean(shapes["answer"] or [0.0]),
        "episodes_checking": len(shapes["check"]),
        "check_mean_reward": statistics.fmean(shapes["check"] or [0.0]),
        "calls_well_formed": calls.get("eval/tool_calls_well_formed", 0.0),
        "errors": float(sum(e.status != "ok" for e in episodes)),
    }
    return result, malformed_calls(episodes), attempts(episodes, tasks)


def attempts(episodes: list[Episode], tasks: list[Task]) -> dict[str, Any]:
    """What the episodes' attempts (checks and answers) did: which one hit, whether the second
    repeated the first, and the checked expressions' shapes, the task's numbers written `n`."""
    hit_at: Counter[int] = Counter()
    second, repeated = 0, 0
    shapes: Counter[str] = Counter()
    sum_solvable: Counter[str] = Counter()  # the first attempt where the sum hits the target
    for episode, task in zip(episodes, tasks, strict=True):
        tried: list[str] = []
        for trajectory in episode.trajectories:
            for step in trajectory.steps:
                calls = parse_tool_calls(step.output.text)
                if not calls:
                    tried.append(step.output.text.strip())
                elif calls[0].error is None:
                    tried.append(str(calls[0].arguments.get("expr", "")))
                    shapes[_shape(tried[-1], task.data["numbers"])] += 1
        hits = [countdown_reward(expr, task.data)[1] for expr in tried]
        if tried and sum(task.data["numbers"]) == task.data["target"]:
            sum_solvable[_against_the_sum(tried[0], task.data["numbers"])] += 1
        if any(hits):
            hit_at[hits.index(True) + 1] += 1
        if len(tried) >= 2:
            second += 1
            repeated += tried[1] == tried[0]
    return {
        "solved_at_attempt": dict(sorted(hit_at.items())),
        "episodes_with_a_second_attempt": second,
        "second_repeats_first": repeated,
        "checked_shapes": shapes.most_common(5),
        "first_attempt_where_the_sum_hits": dict(sum_solvable),
    }


def _against_the_sum(expr: str, numbers: list[int]) -> str:
    """What a first attempt is on a problem the numbers' sum solves: the sum, a sum with a
    number miscopied, or another expression."""
    if not re.fullmatch(r"\d+\+\d+\+\d+", expr):
        return "another expression"
    written = sorted(int(n) for n in expr.split("+"))
    return "the sum" if written == sorted(numbers) else "a sum, a number miscopied"


def _shape(expr: str, numbers: list[int]) -> str:
    """`3*7+12` over the numbers 3 7 12 -> `n*n+n`; a number not in the task stays as written."""
    return re.sub(r"\d+", lambda m: "n" if int(m.group()) in numbers else m.group(), expr)


def malformed_calls(episodes: list[Episode]) -> dict[str, tuple[int, str]]:
    """Malformed calls by what broke (the parser's error, or a parsed call whose run failed),
    with a count and one example reply each."""
    kinds: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for episode in episodes:
        for trajectory in episode.trajectories:
            for step in trajectory.steps:
                if not step.info.get("tool_errors"):
                    continue
                errors = [c.error for c in parse_tool_calls(step.output.text) if c.error]
                kind = errors[0].split(" (")[0] if errors else "parsed, but the tool run failed"
                kinds[kind] += 1
                examples.setdefault(kind, step.output.text)
    return {kind: (n, examples[kind]) for kind, n in kinds.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="tool SFT steps of a variant warm start")
    parser.add_argument("--lr", type=float, help="its learning rate")
    parser.add_argument("--into", type=Path, help="where the variant is built (and cached)")
    parser.add_argument("--model", type=Path, help="a model directory to probe instead")
    parser.add_argument("--checkpoint", type=Path, help="a run checkpoint's backend directory")
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument(
        "--greedy", action="store_true", help="the eval problems at the eval settings"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    recipe, directory = TOOL_WARMSTART_RECIPE, TOOL_WARMSTART_DIR
    if args.steps is not None or args.lr is not None:
        if args.model is not None:
            parser.error("--model and a variant (--steps/--lr): give one or the other")
        if args.into is None:
            parser.error("a variant (--steps/--lr) needs --into DIR")
        changes = {"steps": args.steps, "lr": args.lr}
        recipe = recipe.model_copy(update={k: v for k, v in changes.items() if v is not None})
        directory = args.into
    model = args.model or ensure_warmstart(directory, recipe)
    result, malformed, tries = asyncio.run(
        probe(model, args.problems, args.seed, args.set, args.checkpoint, args.greedy)
    )
    probed = f"tool warm start {recipe.steps} steps at lr {recipe.lr:g}"
    if args.model is not None:
        probed = f"model {args.model}"
    if args.checkpoint is not None:
        probed = f"checkpoint {args.checkpoint} over {model}"
    print(f"{probed}, {'greedy on the eval' if args.greedy else 'sampled at the train'} settings:")
    print(f"  answer at once: {result['episodes_answering']:4.0f} episodes, "
          f"mean reward {result['answer_mean_reward']:.3f}")  # fmt: skip
    print(f"  check first:    {result['episodes_checking']:4.0f} episodes, "
          f"mean reward {result['check_mean_reward']:.3f}")  # fmt: skip
    print(f"  calls well-formed: {result['calls_well_formed']:.1%}; errors: {result['errors']:.0f}")
    for kind, (n, example) in malformed.items():
        print(f"  malformed, {kind}: {n}, e.g. {example!r}")
    if args.greedy:
        solved = tries["solved_at_attempt"]
        print(f"  solved: {sum(solved.values())} of {args.problems}, at attempt {solved}")
        print(f"  the second attempt repeated the first in {tries['second_repeats_first']} of "
              f"{tries['episodes_with_a_second_attempt']} episodes with one")  # fmt: skip
        print(f"  checked expressions by shape: {tries['checked_shapes']}")
        print(f"  first attempts where the sum hits: {tries['first_attempt_where_the_sum_hits']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
