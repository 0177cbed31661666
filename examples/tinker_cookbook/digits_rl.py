"""tinker-cookbook's RL loop, unmodified, on a local `unified tinker-serve`: a task to learn.

The task is the cookbook's own single-turn `ProblemEnv`: one question ("Say a digit."), reward 1
when the answer holds a digit. An untrained built-in model earns it about half the time, so every
group has a spread of rewards and the loop has something to learn within a few steps on a CPU.
Everything else is tinker-cookbook 0.6.1's `rl.train.main` as released: sampling, advantages,
`forward_backward` and `optim_step`, checkpoints in `log_path/checkpoints.jsonl`, resume.

    unified tinker-serve --model builtin:tiny     # prints its URL and the model_name to use
    TINKER_API_KEY=tml-local python -m examples.tinker_cookbook.digits_rl \\
        model_name=<the printed directory> base_url=http://127.0.0.1:8000 log_path=runs/digits

`max_steps_off_policy=1` trains with the cookbook's async loop (`ppo`; the local server refuses
its default `stable_reinforce`, docs/backends/tinker.md). `tests/test_tinker_cookbook.py` runs
this task against the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

RENDERER = "role_colon"
"""The cookbook's plain `User:` / `Assistant:` renderer: any tokenizer, no chat template needed."""


class DigitEnv(ProblemEnv):
    """One question, rewarded 1 when the answer holds a digit."""

    def get_question(self) -> str:
        return "Say a digit."

    def check_answer(self, sample_str: str) -> bool:
        return any(c.isdigit() for c in sample_str)

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "7"


@dataclass
class DigitDataset(RLDataset):
    """`n_batches` batches of `batch_size` groups, each `group_size` copies of the question."""

    renderer: renderers.Renderer
    batch_size: int
    group_size: int
    n_batches: int

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        # format_coef 0: a short answer that does not end in the stop sequence is not penalised.
        env = partial(DigitEnv, self.renderer, format_coef=0.0)
        return [ProblemGroupBuilder(env, self.group_size) for _ in range(self.batch_size)]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class DigitDatasetBuilder(RLDatasetBuilder):
    """The dataset, with the renderer on the tokenizer `model_name` loads (a local directory)."""

    model_name: str
    n_batches: int
    batch_size: int = 2
    group_size: int = 4

    async def __call__(self) -> tuple[DigitDataset, None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name))
        return DigitDataset(renderer, self.batch_size, self.group_size, self.n_batches), None


@chz.chz
class CLIConfig:
    """What the command line sets; the rest is the cookbook's `rl.train.Config` defaults."""

    model_name: str
    base_url: str
    log_path: str
    steps: int = 20
    groups_per_batch: int = 4
    group_size: int = 8
    learning_rate: float = 1e-2
    lora_rank: int = 4
    max_tokens: int = 6
    save_every: int = 10
    max_steps_off_policy: int | None = None


def build_config(cli: CLIConfig) -> train.Config:
    """The cookbook's RL config for `cli`: sync with `importance_sampling`, or async with `ppo`."""
    async_config = None
    if cli.max_steps_off_policy is not None:
        async_config = train.AsyncConfig(
            max_steps_off_policy=cli.max_steps_off_policy,
            groups_per_batch=cli.groups_per_batch,
            loss_fn="ppo",
        )
    return train.Config(
        learning_rate=cli.learning_rate,
        dataset_builder=DigitDatasetBuilder(
            model_name=cli.model_name,
            n_batches=cli.steps,
            batch_size=cli.groups_per_batch,
            group_size=cli.group_size,
        ),
        model_name=cli.model_name,
        renderer_name=RENDERER,
        recipe_name="unified_digits",
        max_tokens=cli.max_tokens,
        lora_rank=cli.lora_rank,
        log_path=cli.log_path,
        base_url=cli.base_url,
        eval_every=0,
        save_every=cli.save_every,
        async_config=async_config,
    )


if __name__ == "__main__":
    asyncio.run(train.main(build_config(chz.entrypoint(CLIConfig))))
