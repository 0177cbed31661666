"""Model tokens train; tool and environment tokens never do, in every backend's conversion.

One real tool episode (built-in chat template and tokenizer, scripted replies) goes through the
tinker backend's Datum conversion and the local backend's loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backends.local.backend import LocalBackend
from backends.tinker.datums import to_datum
from tests.agents import ScriptedEngine, local_loss_rows
from unified.config import load_config
from unified.sequences import sequences_of
from unified.types import Episode, ModelOutput, Task, Trajectory, TrajectoryGroup
from workflows.tools import ToolWorkflow

TASK = Task(id="t", data={"a": 2, "b": 3})
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Adder(ToolWorkflow):
    tools = (add,)
    declare_tools = False  # the built-in model has 256 positions

    def messages(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"{task.data['a']} + {task.data['b']}?"}]

    def reward(self, task: Task, answer: str) -> float:
        return float(answer == "5")


async def tool_episode() -> tuple[Trajectory, ScriptedEngine]:
    engine = ScriptedEngine([CALL, "5"])
    return await Adder().run(TASK, engine), engine


def group_of(trajectory: Trajectory, advantage: float = 1.0) -> TrajectoryGroup:
    episode = Episode(task_id="t", rollout_index=0, trajectories=[trajectory])
    return TrajectoryGroup(
        task_id="t", episodes=[episode], advantages=[advantage], policy_version=0
    )


def tool_message_ids(engine: ScriptedEngine) -> list[int]:
    """The tokens that render the tool's reply: `<|tool|>5<|im_end|>`."""
    return engine.tokenizer.encode("<|tool|>5<|im_end|>")


def find(sequence: list[int], part: list[int]) -> int:
    starts = [i for i in range(len(sequence)) if sequence[i : i + len(part)] == part]
    assert len(starts) == 1, f"expected {part} once in the sequence, found it {len(starts)} times"
    return starts[0]


async def test_a_tool_turn_prompt_extends_the_previous_prompt_and_completion() -> None:
    trajectory, _ = await tool_episode()
    first, second = (step.output for step in trajectory.steps)
    history = first.prompt_ids + first.completion_ids
    assert second.prompt_ids[: len(history)] == history, "re-rendering must not rewrite tokens"


async def test_tinker_datums_weigh_only_the_model_tokens_of_a_merged_tool_episode() -> None:
    trajectory, engine = await tool_episode()
    (sequence,) = sequences_of([group_of(trajectory, advantage=2.0)], loss="ppo")
    first, second = (step.output for step in trajectory.steps)
    sampled_tokens = [t for t, s in zip(sequence.tokens, sequence.mask, strict=True) if s]
    assert sampled_tokens == first.completion_ids + second.completion_ids
    start = find(sequence.tokens, tool_message_ids(engine))
    tool_positions = range(start, start + len(tool_message_ids(engine)))
    assert not any(sequence.mask[p] for p in tool_positions), "tool tokens are observations"
    inputs = to_datum(sequence, "ppo").loss_fn_inputs
    weights = to_datum(sequence, "cross_entropy").loss_fn_inputs["weights"].tolist()
    advantages = inputs["advantages"].tolist()
    # Datum position i predicts token i + 1: token p's weight sits at p - 1.
    assert all(weights[p - 1] == 0.0 and advantages[p - 1] == 0.0 for p in tool_positions)
    assert sum(w > 0 for w in weights) == len(sampled_tokens), "every model token, only them"


async def test_the_local_loss_scores_exactly_each_steps_completion_tokens_in_context() -> None:
    trajectory, _ = await tool_episode()
    chunk, logp_T, model = await local_loss_rows(group_of(trajectory))
    steps = [step.output for step in trajectory.steps]
    sampled = [t for seq in chunk for t, s in zip(seq.tokens, seq.mask, strict=True) if s]
    assert sampled == [t for o in steps for t in o.completion_ids], "targets"
    assert len(chunk) == 1, "each turn's prompt extends the last: one row, prefixes not re-scored"
    assert logp_T.numel() == sum(len(o.completion_ids) for o in steps), "no tool token in the loss"
    # Aligned: the second turn's logprobs equal those of its tokens in one forward pass over the
    # whole episode (prompt, first reply, tool result, second reply).
    full = steps[1].prompt_ids + steps[1].completion_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full])).logits[0]
    start = len(steps[1].prompt_ids)
    expected = torch.log_softmax(logits[start - 1 : len(full) - 1].float(), -1)
    expected = expected.gather(1, torch.tensor(full[start:])[:, None])[:, 0]
    assert torch.allclose(logp_T[-len(expected) :], expected, atol=1e-5)


def one_call_per_run(trajectory: Trajectory) -> list[list[ModelOutput]]:
    return [[step.output] for step in trajectory.steps if step.output.completion_ids]


async def test_scoring_a_trajectorys_turns_in_one_row_trains_exactly_as_scoring_them_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One forward pass per multi-turn trajectory is a saving, not a new objective: the loss,
    its metrics and every gradient equal those of one pass per turn."""
    trajectory, _ = await tool_episode()
    solved = group_of(trajectory, advantage=1.5)
    group = TrajectoryGroup(
        task_id="t",
        episodes=[*solved.episodes, *solved.episodes],
        advantages=[1.5, -0.5],
        policy_version=0,
    )
    config = load_config(
        {"workflow": "tests.agents:LookupBanditWorkflow", "model": "builtin:tiny",
         "trainer": {"kl_coef": 0.1, "entropy_coef": 0.02, "loss_agg": "seq_mean_token_mean"}}
    )  # fmt: skip

    async def gradients() -> tuple[dict[str, float], list[torch.Tensor], int]:
        backend = LocalBackend()
        await backend.setup(config)
        forward = backend.model.forward
        passes = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal passes
            passes += kwargs["input_ids"].shape[0]
            return forward(*args, **kwargs)

        backend.model.forward = counted  # type: ignore[method-assign]
        try:
            metrics = await backend.forward_backward([group])
            grads = [p.grad.clone() for p in backend.model.parameters() if p.grad is not None]
        finally:
            await backend.shutdown()
        return metrics, grads, passes

    merged, merged_grads, merged_rows = await gradients()
    monkeypatch.setattr(Trajectory, "sequences", one_call_per_run)
    apart, apart_grads, apart_rows = await gradients()
    assert (merged_rows, apart_rows) == (2, 4), "two episodes of two turns: 2 rows, or 4 apart"
    assert merged.keys() == apart.keys()
    for key in merged:
        assert merged[key] == pytest.approx(apart[key], rel=1e-5, abs=1e-7), key
    assert len(merged_grads) == len(apart_grads) > 0
    for a, b in zip(merged_grads, apart_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
