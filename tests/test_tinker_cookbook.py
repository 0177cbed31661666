"""tinker-cookbook's own loops, unmodified, against the local Tinker server (`tinker-serve`).

The pinned release (tinker-cookbook 0.6.1, which the README's install command adds) runs its RL
loop (sync, resumed from its `checkpoints.jsonl`, and async off-policy), its SFT loop and its
weights download through the real tinker SDK against a server on 127.0.0.1 serving the built-in
tiny model, offline. The tests assert what the cookbook itself reads back: its checkpoint records,
the step it resumes at, rolling checkpoints deleted on the server, a sampler on its final
checkpoint, an exported model directory that loads into the local backend. The environment is
`examples/tinker_cookbook/digits_rl.py`'s: the cookbook's own `ProblemEnv` with a reward the
untrained tiny model earns about half the time, so groups have non-zero advantages.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "tinker_cookbook",
    reason="tinker-cookbook is not installed (the README's install command adds it: "
    "pip install --no-deps tinker-cookbook==0.6.1 and its dependencies)",
)

import chz
import tinker
import tinker_cookbook
import torch
from tinker_cookbook import checkpoint_utils, weights
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sft_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.utils import cost_estimation

from examples.tinker_cookbook.digits_rl import RENDERER, CLIConfig, build_config
from tinker_server.server import LocalServer
from torchkit.builtin import load_policy

# The cookbook's checkpoint code calls a method SDK 0.38 deprecates (its notice, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:DEPRECATED.*create_rest_client:FutureWarning")

DEADLINE_S = 60
API_KEY = "tml-test"


def test_the_pinned_cookbook_release_is_installed() -> None:
    assert tinker_cookbook.__version__ == "0.6.1", (
        f"the tests are written against tinker-cookbook 0.6.1, found {tinker_cookbook.__version__}"
    )


@dataclass
class Served:
    url: str
    model_name: str
    """The name a cookbook user gives as `model_name`: the directory its tokenizer loads from."""
    rest: tinker.RestClient


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with LocalServer("builtin:tiny", store=tmp_path_factory.mktemp("store")) as url:
        rest = tinker.RestClient(base_url=url, api_key=API_KEY)
        models = rest.get_server_capabilities().result(DEADLINE_S).supported_models
        yield Served(url, str(models[1].model_name), rest)


@pytest.fixture(autouse=True)
def cookbook_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The API key from the environment, as a cookbook user sets it; the root logger restored.

    The cookbook replaces the root logger's handlers when a run starts; the pricing file it
    downloads for cost estimates is marked fetched (none), so the runs stay on 127.0.0.1.
    """
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setattr(cost_estimation, "_pricing_fetched", True)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def rl_config(
    served: Served,
    log_path: Path,
    n_batches: int,
    max_steps_off_policy: int | None = None,
    **fields: Any,
) -> rl_train.Config:
    """The example's config (examples/tinker_cookbook/digits_rl.py), small, with rolling saves."""
    cli = CLIConfig(
        model_name=served.model_name,
        base_url=served.url,
        log_path=str(log_path),
        steps=n_batches,
        groups_per_batch=2,
        group_size=4,
        save_every=2,
        max_steps_off_policy=max_steps_off_policy,
    )
    return chz.replace(build_config(cli), rolling_save_every=1, **fields)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_rl_loop_checkpoints_resumes_and_samples_from_its_final_checkpoint(
    served: Served, tmp_path: Path
) -> None:
    log_path = tmp_path / "rl"
    asyncio.run(rl_train.main(rl_config(served, log_path, n_batches=3)))
    asyncio.run(rl_train.main(rl_config(served, log_path, n_batches=5)))

    steps = [
        row["step"] for row in jsonl(log_path / "metrics.jsonl") if "env/all/reward/total" in row
    ]
    assert steps == [0, 1, 2, 3, 4], f"the resumed run goes on at step 3, no step twice: {steps}"
    records = jsonl(log_path / "checkpoints.jsonl")
    assert [(r["name"], r["batch"]) for r in records if r["name"] == "final"] == [
        ("final", 3),
        ("final", 5),
    ], records
    stored = {
        c.tinker_path: c for c in served.rest.list_user_checkpoints().result(DEADLINE_S).checkpoints
    }
    rolling = [r["state_path"] for r in records if r.get("rolling")]
    periodic = [r["state_path"] for r in records if r["name"] in ("000002", "000004")]
    assert rolling and not set(rolling) & set(stored), "the cookbook deletes rolling checkpoints"
    assert all(stored[path].expires_at is not None for path in periodic), "periodic: 7-day TTL"
    last = checkpoint_utils.get_last_checkpoint(str(log_path))
    assert last is not None and last.batch == 5 and last.sampler_path is not None
    assert stored[last.state_path].expires_at is None, "the final checkpoint never expires"

    service = tinker.ServiceClient(base_url=served.url)
    sampler = service.create_sampling_client(model_path=last.sampler_path).result(DEADLINE_S)
    params = tinker.SamplingParams(max_tokens=4, seed=0)
    answer = sampler.sample(tinker.ModelInput.from_ints([5, 6, 7]), 2, params).result(DEADLINE_S)
    # The trained policy may sample EOS early (EOS always stops): each sequence either runs
    # to max_tokens or ends on a stop.
    assert len(answer.sequences) == 2
    for seq in answer.sequences:
        assert 1 <= len(seq.tokens) <= 4, seq
        assert len(seq.tokens) == 4 or seq.stop_reason == "stop", seq
    service.close("success").result(DEADLINE_S)


def test_the_rl_loop_starts_from_another_runs_checkpoint(served: Served, tmp_path: Path) -> None:
    """`load_checkpoint_path`: the weights (and LoRA shape) come from the checkpoint."""
    service = tinker.ServiceClient(base_url=served.url)
    metadata = {"renderer_name": RENDERER}  # what the cookbook records and checks on loading
    start = service.create_lora_training_client(served.model_name, 2, user_metadata=metadata)
    start_path = start.result(DEADLINE_S).save_state("start").result(DEADLINE_S).path
    service.close("success").result(DEADLINE_S)
    config = rl_config(served, tmp_path, n_batches=2, load_checkpoint_path=start_path)
    assert config.lora_rank == 4
    asyncio.run(rl_train.main(config))

    last = checkpoint_utils.get_last_checkpoint(str(tmp_path))
    assert last is not None
    run = served.rest.get_training_run_by_tinker_path(last.state_path).result(DEADLINE_S)
    assert run.lora_rank == 2, "the run trained the checkpoint's rank-2 adapters"


def test_the_async_rl_loop_trains_off_policy_with_ppo(served: Served, tmp_path: Path) -> None:
    config = rl_config(served, tmp_path, n_batches=4, max_steps_off_policy=1)
    assert config.async_config is not None and config.async_config.loss_fn == "ppo"
    asyncio.run(rl_train.main(config))

    trained = [row for row in jsonl(tmp_path / "metrics.jsonl") if "async/staleness_max" in row]
    assert len(trained) == 4, trained
    assert max(row["async/staleness_max"] for row in trained) == 1, "sampling ran one step ahead"
    # Stale samples are scored by a policy that has moved since: a visible sample/train gap.
    assert max(abs(row["optim/kl_sample_train_v1"]) for row in trained) > 1e-5, trained


def test_the_async_default_loss_is_refused_with_one_line_naming_the_alternatives(
    served: Served, tmp_path: Path
) -> None:
    async_config = rl_train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2)
    assert async_config.loss_fn == "stable_reinforce"
    with pytest.raises(
        tinker.RequestFailedError, match=r"stable_reinforce.*use ppo, cispo or gspo"
    ):
        asyncio.run(rl_train.main(rl_config(served, tmp_path, 2, async_config=async_config)))


def test_the_sft_loop_lowers_its_loss_and_its_checkpoint_downloads_as_a_model_directory(
    served: Served, tmp_path: Path
) -> None:
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=served.model_name,
        renderer_name=RENDERER,
        max_length=192,
        batch_size=16,
    )
    config = sft_train.Config(
        log_path=str(tmp_path / "sft"),
        model_name=served.model_name,
        recipe_name="unified_test",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(
            common_config=common, file_path=str(conversations)
        ),
        learning_rate=1e-2,
        lora_rank=4,
        base_url=served.url,
        save_every=4,
        eval_every=0,
    )
    asyncio.run(sft_train.main(config))

    nll = [
        row["train_mean_nll"]
        for row in jsonl(tmp_path / "sft" / "metrics.jsonl")
        if "train_mean_nll" in row
    ]
    assert len(nll) == 8 and nll[-1] < nll[0] - 0.5, f"supervised loss per step: {nll}"
    last = checkpoint_utils.get_last_checkpoint(str(tmp_path / "sft"), required_key="state_path")
    assert last is not None

    # A training checkpoint: the cookbook exports it encrypted to a fresh age key, downloads,
    # decrypts and deletes the export.
    directory = weights.download(
        tinker_path=last.state_path, output_dir=str(tmp_path / "export"), base_url=served.url
    )
    left = served.rest.list_user_checkpoints().result(DEADLINE_S).checkpoints
    assert not [c for c in left if c.checkpoint_type == "external"], "the export was deleted"
    model, _ = load_policy(directory)
    base, _ = load_policy("builtin:tiny")
    moved = [
        name
        for name, tensor in model.state_dict().items()
        if not torch.equal(tensor, base.state_dict()[name])
    ]
    assert moved, "the download holds the trained weights (adapters merged), not the base model"
