"""verl backend, algorithms: our advantages and losses equal verl's on the same data."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn
from verl.trainer.ppo.core_algos import kl_penalty as verl_kl_penalty
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from backends.verl.algorithms import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ppo_loss_with_kl,
    verl_advantages,
    without_kl,
)
from backends.verl.config import (
    compose_verl_config,
    hydra_overrides,
    parse_verl_config,
    training_worker_config,
)
from backends.verl.convert import to_batch, to_no_padding
from torchkit.builtin import load_policy, save_policy
from torchkit.losses import kl_penalty, per_token_loss, token_weights
from unified.advantages import compute_advantages
from unified.config import load_config
from unified.sequences import TrainingSequence

REWARDS = [[1.0, 0.0, 0.5, 0.0, 1.0, 0.25], [0.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0]]


def flat_advantages(name: str) -> tuple[list[float], list[float]]:
    ours = [a for rewards in REWARDS for a in compute_advantages(name, rewards)]
    ids = [str(g) for g, rewards in enumerate(REWARDS) for _ in rewards]
    return ours, verl_advantages(name, [r for rewards in REWARDS for r in rewards], ids)


@pytest.mark.parametrize("name", ["dr_grpo", "rloo"])
def test_core_advantages_equal_verls(name: str) -> None:
    ours, theirs = flat_advantages(name)
    assert ours == pytest.approx(theirs, abs=1e-6), f"{name}: core vs verl core_algos"


def test_core_grpo_differs_from_verls_only_by_the_unbiased_std() -> None:
    # verl divides by torch.std (n-1); the core by the population std (n).
    ours, theirs = flat_advantages("grpo")
    sizes = [len(rewards) for rewards in REWARDS for _ in rewards]
    scaled = [a * math.sqrt((n - 1) / n) for a, n in zip(ours, sizes, strict=True)]
    assert scaled == pytest.approx(theirs, abs=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("verl-parity") / "tiny"
    save_policy(*load_policy("builtin:tiny"), directory)
    return directory


@functools.cache
def actor_config(
    model_dir: Path,
    loss: str,
    *,
    loss_agg: str = "token_mean",
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
) -> Any:
    """verl's actor config for our `loss`, through the backend's own config translation."""
    trainer = {
        "loss": loss,
        "clip_ratio": 0.2,
        "batch_size": 2,
        "group_size": 2,
        "kl_coef": kl_coef,
        "entropy_coef": entropy_coef,
        "loss_agg": loss_agg,
    }
    config = load_config(
        {
            "workflow": "examples.countdown.workflow:CountdownWorkflow",
            "backend": "verl",
            "trainer": trainer,
        }
    )
    overrides = hydra_overrides(config, parse_verl_config(config), model_dir)
    _, actor = training_worker_config(compose_verl_config(overrides))
    return actor


def batch_BT() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs, old log-probs, advantages, mask: ratios inside and outside the clip range."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2
    old = logp + (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0], dtype=torch.float64)[:, None].expand(4, 6).clone()
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return logp, old, adv, mask


@pytest.mark.parametrize("loss", ["ppo", "cispo", "importance_sampling"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_local_loss_equals_verls_loss_in_value_and_gradient(
    model_dir: Path, loss: str, loss_agg: str
) -> None:
    logp, old, adv, mask = batch_BT()
    config = actor_config(model_dir, loss)
    config.global_batch_info.clear()

    theirs_logp = logp.clone().requires_grad_(True)
    theirs, _ = get_policy_loss_fn(POLICY_LOSSES[loss].loss_mode)(
        old_log_prob=old,
        log_prob=theirs_logp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=LOSS_AGGREGATIONS[loss_agg],
        config=config,
    )
    theirs.backward()

    ours_logp = logp.clone().requires_grad_(True)
    lengths = mask.sum(dim=1).tolist()
    terms = per_token_loss(loss, ours_logp[mask], old[mask], adv[mask], clip_ratio=0.2)
    weights, norm = token_weights(lengths, loss_agg)  # type: ignore[arg-type]
    ours = (terms.loss_T * weights.to(torch.float64)).sum() / norm
    ours.backward()

    # verl adds 1e-8 to per-sequence token counts in seq-mean-token-mean.
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6), "loss value"
    assert ours_logp.grad is not None and theirs_logp.grad is not None
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, msg="loss gradient")


def kl_and_grad(
    fn: Any, log_ratios: torch.Tensor, ref: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = (ref - log_ratios).requires_grad_(True)
    value = fn(logp, ref)
    value.sum().backward()
    assert logp.grad is not None
    return value.detach(), logp.grad


KL_LOG_RATIOS = torch.tensor([-30.0, -3.0, -0.1, 0.0, 0.1, 2.0, 2.5, 3.0, 8.0, 30.0]).double()


def test_kl_penalty_with_clamp_10_is_verls_low_var_kl() -> None:
    ref = torch.full_like(KL_LOG_RATIOS, -1.0)
    ours = kl_and_grad(lambda lp, r: kl_penalty(lp, r, clamp=10.0), KL_LOG_RATIOS, ref)
    theirs = kl_and_grad(lambda lp, r: verl_kl_penalty(lp, r, "low_var_kl"), KL_LOG_RATIOS, ref)
    torch.testing.assert_close(ours, theirs)
    assert float(ours[0].max()) == 10.0 and float(ours[1].abs().max()) < 15.0, "bounded pull"


def test_kl_penalty_unclamped_still_pulls_where_verls_clamp_stops() -> None:
    """The default: verl's `low_var_kl` below its clamp; past ratio ~13 verl's pull is zero."""
    ref = torch.full_like(KL_LOG_RATIOS, -1.0)
    ours, ours_grad = kl_and_grad(kl_penalty, KL_LOG_RATIOS, ref)
    theirs, theirs_grad = kl_and_grad(
        lambda lp, r: verl_kl_penalty(lp, r, "low_var_kl"), KL_LOG_RATIOS, ref
    )
    below = (KL_LOG_RATIOS <= 2.5) & (KL_LOG_RATIOS > -20)
    above = (KL_LOG_RATIOS > 2.5) & (KL_LOG_RATIOS <= 20)
    torch.testing.assert_close(ours[below], theirs[below])
    torch.testing.assert_close(ours_grad[below], theirs_grad[below])
    assert torch.all(theirs_grad[above] == 0.0)
    assert torch.all(ours[above] > 10.0) and torch.all(ours_grad[above] < -10.0)


def test_entropy_bonus_aggregates_like_verls() -> None:
    entropy = torch.rand(3, 5, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    weights, norm = token_weights(mask.sum(dim=1).tolist(), "token_mean")
    ours = float((entropy[mask] * weights).sum() / norm)
    assert ours == pytest.approx(float(agg_loss(entropy, mask, "token-mean")), rel=1e-6)


def flat_sequence_values(values_BR: torch.Tensor, rows: list[TrainingSequence]) -> torch.Tensor:
    """Per-response-token values in verl's no-padding model output: one entry per sequence
    token, where position t holds the value of token t + 1 (prompt and last position unused)."""
    zero = values_BR.new_zeros(1)
    pieces = []
    for b, row in enumerate(rows):
        n = len(row.tokens) - row.prompt_length
        pieces += [zero.expand(row.prompt_length - 1), values_BR[b, :n], zero]
    return torch.cat(pieces)


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("kl_clamp", [None, 10.0])
def test_local_loss_with_kl_and_entropy_equals_the_loss_verls_workers_run(
    model_dir: Path, loss: str, loss_agg: str, kl_clamp: float | None
) -> None:
    # The KL penalty against a reference, plus the entropy bonus, through `ppo_loss_with_kl` (the
    # function verl's workers run: verl's `ppo_loss` and our KL term) and through the local
    # backend's per-token terms; the log ratios reach past verl's clamp (k3 > 10 from ~2.6).
    kl_coef, entropy_coef = 0.3, 0.02
    config = actor_config(
        model_dir, loss, loss_agg=loss_agg, kl_coef=kl_coef, entropy_coef=entropy_coef
    )
    assert config.use_kl_loss and config.kl_loss_coef == kl_coef
    config.global_batch_info.clear()
    logp, old, adv, mask = batch_BT()
    g = torch.Generator().manual_seed(2)
    ref = logp + (torch.rand(logp.shape, generator=g, dtype=torch.float64) - 0.5) * 8.0
    assert float((ref - logp)[mask].max()) > 3.0, "some tokens past verl's clamp"
    entropy = torch.rand(logp.shape, generator=g, dtype=torch.float64)
    lengths = mask.sum(dim=1).tolist()
    rows = [
        TrainingSequence(
            tokens=[1] * (2 + b) + [2] * n,
            mask=[False] * (2 + b) + [True] * n,
            logprobs=[0.0] * (2 + b + n),
            advantages=[0.0] * (2 + b + n),
            prompt_length=2 + b,
        )
        for b, n in enumerate(lengths)
    ]
    data = to_no_padding(to_batch(rows, pad_token_id=0))
    width = max(lengths)
    data["old_log_probs"] = old[:, :width].float()
    data["advantages"] = (adv * mask)[:, :width].float()
    data["ref_log_prob"] = ref[:, :width].float()
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)

    theirs_logp = logp.clone().requires_grad_(True)
    output = {
        "log_probs": flat_sequence_values(theirs_logp[:, :width].float(), rows),
        "entropy": flat_sequence_values(entropy[:, :width].float(), rows),
    }
    run = functools.partial(
        ppo_loss_with_kl, config, pg_config=without_kl(config), kl_clamp=kl_clamp
    )
    theirs, metrics = run(output, data)
    theirs.backward()
    assert "kl_loss" in metrics and metrics["kl_coef"] == kl_coef
    verls_own, _ = ppo_loss(config, output, data)
    if kl_clamp == 10.0:
        assert float(verls_own.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5), (
            "low_var_kl"
        )
    else:
        assert float(verls_own.detach()) < float(theirs.detach()) - 0.1, "verl's clamp drops KL"

    ours_logp = logp.clone().requires_grad_(True)
    terms = per_token_loss(loss, ours_logp[mask], old[mask], adv[mask], clip_ratio=0.2)
    loss_T = terms.loss_T + kl_coef * kl_penalty(ours_logp[mask], ref[mask], kl_clamp)
    loss_T = loss_T - entropy_coef * entropy[mask]
    weights, norm = token_weights(lengths, loss_agg)  # type: ignore[arg-type]
    ours = (loss_T * weights.to(torch.float64)).sum() / norm
    ours.backward()

    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5), "loss value"
    assert ours_logp.grad is not None and theirs_logp.grad is not None
    torch.testing.assert_close(
        ours_logp.grad, theirs_logp.grad, rtol=1e-4, atol=1e-6, msg="loss gradient"
    )
