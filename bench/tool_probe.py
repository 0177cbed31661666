"""What RL starts from: the tool agent's warm start sampled at temperature 1, episodes by shape.

RL explores by sampling, so a warm start whose sampled calls are garbled, or whose checks score
no better than direct answers, gives RL no reason to keep the tool. This runs the countdown tool
agent on train problems with the train sampling settings and prints, for episodes that answer at
once and those that check first, how many there are and their mean reward, and the share of
sampled calls that were well-formed. `--steps/--lr` build a variant tool warm start (the default
recipe otherwise) in `--into`, cached like the default one.

    python bench/tool_probe.py --problems 512
    python bench/tool_probe.py --steps 100 --lr 2e-3 --into .cache/tool-warmstart-100-2e-3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.countdown.prepare import TOOL_WARMSTART_DIR, TOOL_WARMSTART_RECIPE, ensure_warmstart
from examples.countdown.tasks import make_tasks
from unified.config import load_config
from unified.evaluation import tool_call_metrics
from unified.protocol import create_backend
from unified.rollout import SamplingEngine, WorkflowDeadlines, resolve_workflow, run_episode
from unified.types import Episode

CONFIG = "examples/countdown/local_tool_async.yaml"


async def probe(model: Path, problems: int, seed: int) -> dict[str, float]:
    config = load_config(CONFIG, [f"model={model}"])
    backend = create_backend(config.backend)
    await backend.setup(config)
    try:
        engine = backend.rollout_engine()
        workflow = resolve_workflow(config.workflow)
        defaults = config.sampling.train.model_dump()
        deadlines = WorkflowDeadlines(config.trainer.workflow_timeout)
        tasks = make_tasks(problems, split="train", seed=seed)

        async def one(index: int) -> Episode:
            view = SamplingEngine(engine, defaults, seed + index)
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
    return {
        "episodes_answering": len(shapes["answer"]),
        "answer_mean_reward": statistics.fmean(shapes["answer"] or [0.0]),
        "episodes_checking": len(shapes["check"]),
        "check_mean_reward": statistics.fmean(shapes["check"] or [0.0]),
        "calls_well_formed": calls.get("eval/tool_calls_well_formed", 0.0),
        "errors": float(sum(e.status != "ok" for e in episodes)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="tool SFT steps of a variant warm start")
    parser.add_argument("--lr", type=float, help="its learning rate")
    parser.add_argument("--into", type=Path, help="where the variant is built (and cached)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    recipe, directory = TOOL_WARMSTART_RECIPE, TOOL_WARMSTART_DIR
    if args.steps is not None or args.lr is not None:
        if args.into is None:
            parser.error("a variant (--steps/--lr) needs --into DIR")
        changes = {"steps": args.steps, "lr": args.lr}
        recipe = recipe.model_copy(update={k: v for k, v in changes.items() if v is not None})
        directory = args.into
    model = ensure_warmstart(directory, recipe)
    result = asyncio.run(probe(model, args.problems, args.seed))
    print(
        f"tool warm start {recipe.steps} steps at lr {recipe.lr:g}, sampled at the train settings:"
    )
    print(f"  answer at once: {result['episodes_answering']:4.0f} episodes, "
          f"mean reward {result['answer_mean_reward']:.3f}")  # fmt: skip
    print(f"  check first:    {result['episodes_checking']:4.0f} episodes, "
          f"mean reward {result['check_mean_reward']:.3f}")  # fmt: skip
    print(f"  calls well-formed: {result['calls_well_formed']:.1%}; errors: {result['errors']:.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
