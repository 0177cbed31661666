"""tinker-cookbook's own loops, unmodified, against the local Tinker server (`tinker-serve`).

The pinned release (tinker-cookbook 0.6.1, which the README's install command adds) runs its RL
loop (sync, resumed from its `checkpoints.jsonl`, and async off-policy), its SFT loop, its
distillation recipes (`train_off_policy` and `sdft`: soft `(N, K)` targets from a teacher's top-K)
and its weights download through the real tinker SDK against a server on 127.0.0.1 serving the
built-in tiny model, offline. The tests assert what the cookbook itself reads back: its
checkpoint records, the step it resumes at, rolling checkpoints deleted on the server, a sampler
on its final checkpoint, an exported model directory that loads into the local backend, the
losses it logs. The environment is `examples/tinker_cookbook/digits_rl.py`'s: the cookbook's own
`ProblemEnv` with a reward the untrained tiny model earns about half the time, so groups have
non-zero advantages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
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
from tinker_cookbook import checkpoint_utils, renderers, weights
from tinker_cookbook.distillation import sdft, train_off_policy
from tinker_cookbook.distillation.datasets import TeacherConfig
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder
from tinker_cookbook.supervised import train as sft_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import (
    ChatDatasetBuilderCommonConfig,
    SupervisedDataset,
    SupervisedDatasetBuilder,
)
from tinker_cookbook.tokenizer_utils import get_tokenizer
from tinker_cookbook.utils import cost_estimation

from examples.tinker_cookbook.digits_rl import RENDERER, CLIConfig, DigitEnv, build_config
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


class _OneBatch(SupervisedDataset):
    """The same batch at every index."""

    def __init__(self, batch: list[tinker.Datum], n_batches: int) -> None:
        self.batch, self.n_batches = batch, n_batches

    def get_batch(self, index: int) -> list[tinker.Datum]:
        return self.batch

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class FirstBatchRepeated(SupervisedDatasetBuilder):
    """The cookbook's conversation dataset's first batch, `n_batches` times: every step distills
    the same examples, so the loss on them can be compared from step to step."""

    inner: FromConversationFileBuilder
    n_batches: int

    def __call__(self) -> tuple[SupervisedDataset, None]:
        train, _ = self.inner()
        return _OneBatch(train.get_batch(0), self.n_batches), None


def top_k_cross_entropy(batch: list[tinker.Datum], k: int) -> float:
    """The recipe's loss on `batch` while the student is still the base model (its teacher):
    at every trained position, `-sum_k p_k * logp_k` over the base model's top-k tokens, `p` their
    probabilities renormalised over the k (tinker-cookbook's `_collect_topk_for_datum`)."""
    model, _ = load_policy("builtin:tiny")
    total = 0.0
    with torch.no_grad():
        for datum in batch:
            ids = torch.tensor(datum.model_input.to_ints())[None]
            logp_NV = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            top_NK = logp_NV.topk(k, dim=-1).values
            p_NK = torch.softmax(top_NK, -1)
            trained_N = datum.loss_fn_inputs["weights"].to_torch() > 0
            total -= float((p_NK * top_NK).sum(-1)[trained_N].sum())
    return total


def test_off_policy_distillation_trains_on_the_teachers_top_k_soft_targets(
    served: Served, tmp_path: Path
) -> None:
    """`distillation.train_off_policy`: the teacher (the base model, sampled with
    `topk_prompt_logprobs`) turns each SFT datum into `(N, K)` `target_tokens` and `weights`,
    and `cross_entropy` trains the student on them."""
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=served.model_name,
        renderer_name=RENDERER,
        max_length=128,
        batch_size=4,
    )
    dataset = FirstBatchRepeated(
        inner=FromConversationFileBuilder(common_config=common, file_path=str(conversations)),
        n_batches=4,
    )
    config = train_off_policy.Config(
        learning_rate=1e-2,
        dataset_configs=[
            train_off_policy.DatasetWithTeacher(
                dataset_builder=dataset, teacher_config=TeacherConfig(base_model=served.model_name)
            )
        ],
        model_name=served.model_name,
        recipe_name="unified_test",
        renderer_name=RENDERER,
        lora_rank=4,
        n_teacher_targets=4,
        batch_size=4,
        save_every=2,
        eval_every=0,
        log_path=str(tmp_path / "distill"),
        base_url=served.url,
    )
    asyncio.run(train_off_policy.main(config))

    losses = [
        row["train/loss:sum"]
        for row in jsonl(tmp_path / "distill" / "metrics.jsonl")
        if "train/loss:sum" in row
    ]
    assert len(losses) == 4, losses
    batch, _ = dataset()
    expected = top_k_cross_entropy(batch.get_batch(0), k=4)
    assert losses[0] == pytest.approx(expected, rel=1e-4), (
        "step 0 (student = teacher): the top-4 soft-target cross-entropy, summed"
    )
    assert losses[-1] < losses[0] - 50, f"the student moves toward the teacher's top 4: {losses}"
    last = checkpoint_utils.get_last_checkpoint(str(tmp_path / "distill"))
    assert last is not None and last.batch == 4, last


@dataclass
class DigitDemonstrations:
    """SDFT's batches: the digits question twice per batch, each with "7" as the golden answer
    the teacher sees."""

    renderer: renderers.Renderer
    n_batches: int

    def get_batch(self, index: int) -> tuple[Sequence[EnvGroupBuilder], list[str], list[str]]:
        env = partial(DigitEnv, self.renderer, format_coef=0.0)
        builders = [ProblemGroupBuilder(env, 2) for _ in range(2)]
        return builders, ["Say a digit."] * 2, ["7"] * 2

    def __len__(self) -> int:
        return self.n_batches


@pytest.mark.parametrize("reverse", [False, True], ids=["forward KL", "reverse KL"])
def test_sdft_distills_the_teachers_top_k_on_policy(
    served: Served, tmp_path: Path, reverse: bool
) -> None:
    """`distillation.sdft`: the student samples, the teacher (the base model, shown the golden
    answer) scores its top 4 at every completion position; forward KL trains `cross_entropy` on
    `(N, 4)` soft targets, reverse KL a client-side loss through `forward_backward_custom`, whose
    mostly-zero `(N, 4)` gradient weights the SDK sends as CSR."""
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(served.model_name))
    config = sdft.Config(
        model_name=served.model_name,
        recipe_name="unified_test",
        renderer_name=RENDERER,
        lora_rank=4,
        base_url=served.url,
        learning_rate=1e-4,
        max_tokens=8,
        topk=4,
        reverse=reverse,
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "sdft"),
    )
    asyncio.run(sdft.main(config, DigitDemonstrations(renderer, n_batches=3)))

    rows = [row for row in jsonl(tmp_path / "sdft" / "metrics.jsonl") if "sdft/topk" in row]
    assert [row["sdft/topk"] for row in rows] == [4.0] * 3, rows
    trained = "sdft/reverse_kl_positions" if reverse else "sdft/total_completion_tokens"
    assert all(row[trained] > 0 for row in rows), f"every step trains on {trained}: {rows}"
    if reverse:
        # The custom loss's surrogate ran on the server: its (N, 4) weights arrived as CSR.
        # (Its sum is the weights times the logprobs, either sign: nonzero is what it shows.)
        sums = [row["surrogate_loss:sum"] for row in rows]
        assert all(math.isfinite(x) and x != 0 for x in sums), rows
    last = checkpoint_utils.get_last_checkpoint(str(tmp_path / "sdft"))
    assert last is not None and last.batch == 3, last
