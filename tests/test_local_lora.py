"""`local.lora_rank`: the local backend trains the Tinker server's LoRA adapters, samples merged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backends.local import backend as local_backend
from backends.local.backend import LocalBackend
from tests.test_local_backend import PROMPTS, group_of, local_config, sample
from torchkit.builtin import load_policy
from torchkit.lora import LoraLinear, LoraTargets
from unified.config import TrainerConfig
from unified.errors import BackendError, ConfigError
from unified.sequences import sequences_of


def lora_config(rank: int = 4) -> TrainerConfig:
    return local_config(local={"lora_rank": rank}, lr=0.05, kl_coef=0.05)


async def trained(config: TrainerConfig | None = None) -> LocalBackend:
    """A LoRA backend after one optimizer step on sampled outputs, the sampler synced."""
    backend = LocalBackend()
    await backend.setup(config or lora_config())
    outputs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS)]
    await backend.forward_backward([group_of(outputs, [1.0, -1.0, 1.0, -1.0])])
    await backend.optim_step()
    await backend.on_policy_updated(1)
    return backend


async def test_only_the_adapters_train_and_the_sampler_samples_the_merged_policy() -> None:
    base, _ = load_policy("builtin:tiny")
    backend = await trained()
    adapters = [m for m in backend.model.modules() if isinstance(m, LoraLinear)]
    assert adapters and any(bool(m.lora_B.abs().sum() > 0) for m in adapters)
    trained_state = backend.model.state_dict()
    for name, weight in base.state_dict().items():  # every base weight (embedding too) as built
        assert torch.equal(trained_state[name], weight), f"{name} changed"
    # The sampler's logprobs are the trained (adapted) policy's: merged, with an untied head.
    outputs = await asyncio.gather(*[sample(backend, p, 10 + i) for i, p in enumerate(PROMPTS)])
    assert all(o.policy_version == 1 for o in outputs)
    rows = sequences_of([group_of(list(outputs), [0.0] * len(outputs))], loss="ppo")
    with torch.no_grad():
        recomputed = backend._score(backend.model, rows, with_entropy=False).logp_T
        reference = backend._score(backend.reference, rows, with_entropy=False).logp_T
    sampled = torch.tensor([lp for o in outputs for lp in o.logprobs])
    assert (recomputed - sampled).abs().max().item() < 1e-5
    assert (reference - sampled).abs().max().item() > 1e-3  # the step did change the policy
    await backend.shutdown()


async def test_an_export_is_a_plain_model_with_the_adapters_merged(tmp_path: Path) -> None:
    backend = await trained()
    await backend.export_model(tmp_path / "policy")
    saved = load_file(tmp_path / "policy" / "model.safetensors")
    assert "lm_head.weight" in saved and not any("lora" in key for key in saved)
    exported, _ = load_policy(str(tmp_path / "policy"))
    assert exported.config.tie_word_embeddings is False
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        expected = backend.model(ids).logits
        assert (exported(ids).logits - expected).abs().max().item() < 1e-5
    await backend.shutdown()


def test_a_lora_rank_below_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"local\.lora_rank.*greater than or equal to 1"):
        LocalBackend().check_config(lora_config(0))


@pytest.mark.parametrize(
    ("saved", "loading", "message"),
    [
        ({"lora_rank": 4}, {}, r"trained LoRA adapters of rank 4 .* local\.lora_rank=4"),
        ({"lora_rank": 4}, {"lora_rank": 8}, r"rank 4 but local\.lora_rank is 8"),
        ({}, {"lora_rank": 4}, r"trained every weight .* with no local\.lora_rank"),
    ],
)
async def test_a_checkpoint_loaded_with_another_lora_setting_is_one_line(
    tmp_path: Path, saved: dict[str, int], loading: dict[str, int], message: str
) -> None:
    first = LocalBackend()
    await first.setup(local_config(local=saved))
    await first.save_checkpoint(tmp_path / "ckpt")
    second = LocalBackend()
    await second.setup(local_config(local=loading))
    with pytest.raises(BackendError, match=message) as caught:
        await second.load_checkpoint(tmp_path / "ckpt")
    assert "\n" not in str(caught.value)
    await first.shutdown()
    await second.shutdown()


async def test_a_model_whose_layers_the_adapters_miss_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As for a model without Qwen2/Llama layer names: no attention or MLP layer matches.
    monkeypatch.setattr(
        local_backend,
        "LoraTargets",
        lambda **kw: LoraTargets(**({"attn": False, "mlp": False} | kw)),
    )
    with pytest.raises(ConfigError, match=r"local\.lora_rank: no attention or MLP layer"):
        await LocalBackend().setup(lora_config())
