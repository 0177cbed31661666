"""The countdown warm start: a built-in model taught the answer format, cached on disk.

`ensure_warmstart(directory)` builds it on first use and reuses it afterwards: random valid
expressions for train prompts (`warmstart.py`), then `unified.sft.run_sft` on the local backend,
exported as a Hugging Face directory. The recipe is written next to the model; a directory whose
recipe differs is rebuilt, and the same recipe always gives the same model (seeded).
`warmstart_model` is the model provider the countdown configs name
(`model: examples.countdown.prepare:warmstart_model`), so `unified train` builds it too;
`tool_warmstart_model` is the tool agent's, built on top of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from examples.countdown.warmstart import tool_warmstart_examples
from unified.config import load_config
from unified.sft import run_sft
from unified.types import Task

__all__ = [
    "TOOL_WARMSTART_DIR",
    "TOOL_WARMSTART_RECIPE",
    "WARMSTART_DIR",
    "WarmStartRecipe",
    "ensure_warmstart",
    "is_built",
    "tool_warmstart_model",
    "warmstart_model",
]

RECIPE_FILE = "warmstart_recipe.json"
# Relative to the working directory: the project root, where the configs' import paths resolve.
WARMSTART_DIR = Path(".cache/countdown-warmstart-tiny")
TOOL_WARMSTART_DIR = Path(".cache/countdown-tool-warmstart-tiny")


class WarmStartRecipe(BaseModel):
    """What the warm-started model is made of; changing any field rebuilds it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_model: str = "builtin:tiny"
    base: WarmStartRecipe | None = None
    """The recipe of `base_model` when that is another warm start: a change there rebuilds this
    one too (the directory's recipe file is the cache key, and a provider path never changes)."""
    steps: int = 600
    """SFT steps. After 600 (not 400) RL turns to the subtraction for small targets at step
    400-600 instead of 450-750 or never, with time left to settle it (docs/results.md)."""
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    numbers: int = 3
    max_number: int = 20
    in_order: float = 0.5
    tool_share: float = 0.0
    """Share of problems checked with the calculator first (`tool_warmstart_examples`)."""
    max_checks: int = 2
    """Checks of a checked problem before its answer (the tool agent's turns, less one)."""
    target_share: float = 0.25
    """Share of examples that ask for the target back (`warmstart.py`): RL starts from a model
    that reads it. Without them 8 of 43 runs of the main command ended within 3 points of the
    best fixed pattern; with them 1 of 14, and none since the 600 steps (docs/results.md)."""
    revision: int = 2
    """Bumped when the same fields build another model: 2 since the built-in tokenizer spells the
    tool-call format in a few tokens. A cache written before a field existed is rebuilt."""


TOOL_WARMSTART_RECIPE = WarmStartRecipe(
    base_model="examples.countdown.prepare:warmstart_model",
    base=WarmStartRecipe(),
    steps=300,
    lr=3e-3,
    tool_share=0.5,
    in_order=1.0,
    target_share=0.0,  # its base reads the target already
)
"""The tool agent's: the single-turn warm start (which copies the numbers reliably), then 300
steps checking half the problems with `calc` (up to two checks, then an answer). 300 steps at
3e-3 keep 90% of calls well-formed when sampled at temperature 1, and direct answers as good as
the single-turn warm start's; 100 at 2e-3 garbled most calls. Its expressions keep the prompt's
order of the numbers (`in_order=1.0`): RL then miscopies fewer numbers into its checks (a `1`
written `11`) and gains more in 250 steps (docs/benchmarks.md, "Numbers in the prompt's order")."""


def is_built(directory: Path, recipe: WarmStartRecipe) -> bool:
    """Whether `directory` holds the model `recipe` builds (its recipe file, field for field)."""
    found = directory / RECIPE_FILE
    # Compared as written, not validated: a field missing from an old cache must not default.
    return found.is_file() and json.loads(found.read_text()) == recipe.model_dump()


def ensure_warmstart(directory: str | Path, recipe: WarmStartRecipe | None = None) -> Path:
    """The warm-started model directory, built first if missing or made by another recipe."""
    recipe = recipe or WarmStartRecipe()
    directory = Path(directory)
    if is_built(directory, recipe):
        return directory
    print(
        f"building the countdown warm start in {directory} ({recipe.steps} SFT steps)", flush=True
    )
    examples = tool_warmstart_examples(
        recipe.steps * recipe.batch_size,
        seed=recipe.seed,
        numbers=recipe.numbers,
        max_number=recipe.max_number,
        in_order=recipe.in_order,
        tool_share=recipe.tool_share,
        max_checks=recipe.max_checks,
        target_share=recipe.target_share,
    )
    tasks = [Task(id=f"warmstart-{i}", data=example) for i, example in enumerate(examples)]
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Staged beside the target so the final rename is atomic: never a half-written model.
    with tempfile.TemporaryDirectory(prefix=".warmstart-", dir=directory.parent) as scratch:
        config = load_config(
            {
                "name": "warmstart",
                "backend": "local",
                "workflow": "examples.countdown.workflow:CountdownWorkflow",
                "model": recipe.base_model,
                "trainer": {
                    "total_steps": recipe.steps,
                    "batch_size": recipe.batch_size,
                    "lr": recipe.lr,
                    "lr_schedule": "cosine",
                    "warmup_steps": min(10, recipe.steps // 10),
                    "seed": recipe.seed,
                },
                # Passes of 64 sequences, as before the local default became 32: the same
                # recipe keeps giving the same model (micro-batching changes float rounding).
                "local": {"seed": recipe.seed, "forward_batch_size": 64},
                "logging": {"run_dir": scratch, "console": True},
            }
        )
        staged = Path(scratch) / "model"
        asyncio.run(run_sft(config, output=staged, examples=tasks))
        (staged / RECIPE_FILE).write_text(json.dumps(recipe.model_dump(), indent=2))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staged, directory)
    return directory


def warmstart_model() -> Path:
    """Model provider: the default warm start in `.cache/`, built on first use (~1.5 min)."""
    return ensure_warmstart(WARMSTART_DIR)


def tool_warmstart_model() -> Path:
    """Model provider: the tool agent's warm start in `.cache/`, built on first use."""
    return ensure_warmstart(TOOL_WARMSTART_DIR, TOOL_WARMSTART_RECIPE)
