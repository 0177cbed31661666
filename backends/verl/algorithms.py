"""Our loss and advantage names on verl's `core_algos`, so every backend trains the same objective.

Losses (per token, `r = exp(logp - old)`, aggregated by verl's `agg_loss`):

- `ppo`                 -> verl `vanilla` with `clip_ratio_c` out of reach: -min(r A, clip(r) A),
                           exactly `torchkit.losses` (verl's dual clip is opt-in here,
                           `verl.dual_clip_ratio`);
- `cispo`               -> verl `cispo`: -sg(clip(r)) A logp;
- `importance_sampling` -> verl `vanilla` with the clip range opened to [0, inf): -r A;
- `cross_entropy`       -> no verl policy loss (verl's SFT trainer has its own); refused.

Aggregation: `token_mean`, `seq_mean_token_mean`, `seq_mean_token_sum` -> verl's `token-mean`,
`seq-mean-token-mean`, `seq-mean-token-sum`. Entropy bonus -> `entropy_coeff`.

KL penalty: `trainer.kl_coef * k3(ref || train)` per token, aggregated like the policy loss,
against the log-probs of a frozen reference worker holding the initial weights (verl's `ref`
role). The term is the local backend's `kl_penalty`, added by `ppo_loss_with_kl` around verl's
`ppo_loss`: verl's own `low_var_kl` clamps each token's value at 10, past which the pull back to
the reference stops, and under it the countdown recipe collapsed onto one answer (entropy 0.75 ->
0.03, stopped at step 178 of 900) where the local backend's unclamped term held it (0.17-0.19).
`verl.kl_clamp: 10` gives verl's form.

Advantages are the trainer's (`unified.advantages`), computed once for every backend; verl's
estimators are the reference they are tested against: `grpo` -> `grpo` (verl divides by the
unbiased group std, the core by the population std: the tests pin the factor sqrt((n-1)/n)),
`dr_grpo` -> `grpo` with `norm_adv_by_std_in_grpo=False`, `rloo` -> `rloo`; `reinforce` (the
reward itself) has no verl estimator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_LOSS_TYPE",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "UNBOUNDED_RATIO",
    "PolicyLoss",
    "ppo_loss_with_kl",
    "verl_advantages",
]

# A ratio bound no token reaches (verl clamps log-ratios to +-20, so ratios stay below 5e8).
UNBOUNDED_RATIO = 1.0e9


@dataclass(frozen=True)
class PolicyLoss:
    """A verl policy loss mode and the clip settings that make it equal one of our losses."""

    loss_mode: str
    opens_clip_range: bool = False

    def actor_settings(self, clip_ratio: float, dual_clip_ratio: float | None) -> dict[str, Any]:
        """The `actor_rollout_ref.actor` keys this loss sets in verl's config."""
        low, high = (1.0, UNBOUNDED_RATIO) if self.opens_clip_range else (clip_ratio, clip_ratio)
        return {
            "policy_loss.loss_mode": self.loss_mode,
            "clip_ratio": clip_ratio,
            "clip_ratio_low": low,
            "clip_ratio_high": high,
            "clip_ratio_c": dual_clip_ratio if dual_clip_ratio is not None else UNBOUNDED_RATIO,
        }


POLICY_LOSSES: Mapping[str, PolicyLoss] = MappingProxyType(
    {
        "ppo": PolicyLoss("vanilla"),
        "cispo": PolicyLoss("cispo"),
        "importance_sampling": PolicyLoss("vanilla", opens_clip_range=True),
    }
)

LOSS_AGGREGATIONS: Mapping[str, str] = MappingProxyType(
    {
        "token_mean": "token-mean",
        "seq_mean_token_mean": "seq-mean-token-mean",
        "seq_mean_token_sum": "seq-mean-token-sum",
    }
)

# verl's name for the k3 estimator of KL(train || ref); the loss verl's workers run replaces its
# clamped value with `kl_penalty`'s (`ppo_loss_with_kl`).
KL_LOSS_TYPE = "low_var_kl"


def without_kl(actor_config: Any) -> Any:
    """`actor_config` with verl's own KL term off, for `ppo_loss_with_kl`'s `pg_config`."""
    return replace(actor_config, use_kl_loss=False)


def ppo_loss_with_kl(
    config: Any,
    model_output: Mapping[str, Any],
    data: Any,
    dp_group: Any = None,
    *,
    pg_config: Any,
    kl_clamp: float | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's `ppo_loss` (policy loss and entropy bonus, from `pg_config`: `config` without
    verl's KL) plus `config.kl_loss_coef` times the local backend's `kl_penalty` against
    `data["ref_log_prob"]`, aggregated as verl aggregates its own KL loss.

    The loss function verl's workers run (`TrainingWorker.set_loss_fn`), in their processes.
    """
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import Metric
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from torchkit.losses import kl_penalty

    loss, metrics = ppo_loss(pg_config, model_output, data, dp_group)
    if not config.use_kl_loss:
        return loss, metrics
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    padded = data.select("response_mask", "ref_log_prob").to_padded_tensor()
    kl_loss = agg_loss(
        loss_mat=kl_penalty(log_prob, padded["ref_log_prob"], kl_clamp),
        loss_mask=padded["response_mask"].to(bool),
        loss_agg_mode=config.loss_agg_mode,
        **pg_config.global_batch_info,
    )
    aggregation = metrics["actor/pg_loss"].aggregation
    metrics["kl_loss"] = Metric(value=kl_loss, aggregation=aggregation)
    metrics["kl_coef"] = config.kl_loss_coef
    return loss + config.kl_loss_coef * kl_loss, metrics


# Our estimator -> (verl estimator, its keyword arguments); None: verl has no equivalent.
ADVANTAGE_ESTIMATORS: Mapping[str, tuple[str, dict[str, Any]] | None] = MappingProxyType(
    {
        "grpo": ("grpo", {"norm_adv_by_std_in_grpo": True}),
        "dr_grpo": ("grpo", {"norm_adv_by_std_in_grpo": False}),
        "rloo": ("rloo", {}),
        "reinforce": None,
    }
)


def verl_advantages(name: str, rewards: Sequence[float], group_ids: Sequence[str]) -> list[float]:
    """Per-rollout advantages from verl's estimator for our `name` (one response token each)."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    mapped = ADVANTAGE_ESTIMATORS.get(name)
    if mapped is None:
        raise ValueError(f"advantage estimator {name!r} has no verl counterpart")
    verl_name, kwargs = mapped
    scores_B1 = torch.tensor(rewards, dtype=torch.float32)[:, None]
    advantages_B1, _ = get_adv_estimator_fn(verl_name)(
        token_level_rewards=scores_B1,
        response_mask=torch.ones_like(scores_B1),
        index=np.array(list(group_ids), dtype=object),
        **kwargs,
    )
    return [float(a) for a in advantages_B1[:, 0]]
