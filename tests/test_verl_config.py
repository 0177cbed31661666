"""verl backend, config: our config becomes a verl Hydra config that verl itself validates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.verl.config import (
    compose_verl_config,
    hydra_overrides,
    parse_verl_config,
    reference_worker_config,
    training_worker_config,
)
from torchkit.builtin import load_policy, save_policy
from unified.config import TrainerConfig, load_config
from unified.errors import ConfigError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("verl-config") / "tiny"
    save_policy(*load_policy("builtin:tiny"), directory)
    return directory


def run_config(**sections: Any) -> TrainerConfig:
    base: dict[str, Any] = {
        "workflow": "examples.countdown.workflow:CountdownWorkflow",
        "backend": "verl",
        "trainer": {"batch_size": 4, "group_size": 3, "lr": 2e-4, "loss": "ppo"},
    }
    return load_config(base | sections)


def composed(config: TrainerConfig, model_dir: Path) -> Any:
    return compose_verl_config(hydra_overrides(config, parse_verl_config(config), model_dir))


def test_sync_config_translates_to_a_validated_verl_config(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    verl_config = composed(run_config(mode="sync"), model_dir)
    assert capsys.readouterr().out == "", "verl's validation prints nothing on a run's console"
    actor = verl_config.actor_rollout_ref.actor
    assert actor.ppo_mini_batch_size == 4, "one optimizer step per trainer step"
    assert verl_config.actor_rollout_ref.rollout.n == 3, "group_size is verl's rollout.n"
    assert actor.optim.lr == pytest.approx(2e-4)
    assert actor.policy_loss.loss_mode == "vanilla"
    assert verl_config.actor_rollout_ref.model.path == str(model_dir)
    assert verl_config.trainer.device == "cpu", "no GPU here: the workers train on CPU"
    worker_config, actor_config = training_worker_config(verl_config)
    assert worker_config.engine_config.micro_batch_size_per_gpu == 8
    assert actor_config.clip_ratio_c > 1e8, "verl's dual clip is off, like the local backend"


def test_the_trainers_optimizer_and_loss_agg_reach_verls_actor(model_dir: Path) -> None:
    optimizer = {"betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "max_grad_norm": 0.5}
    trainer = {"batch_size": 4, "group_size": 3, "loss": "ppo", "optimizer": optimizer}
    trainer["loss_agg"] = "seq_mean_token_sum"
    _, actor = training_worker_config(composed(run_config(trainer=trainer), model_dir))
    assert tuple(actor.optim.betas) == (0.8, 0.99) and actor.optim.weight_decay == 0.1
    assert actor.optim.clip_grad == 0.5
    assert dict(actor.optim.override_optimizer_config) == {"eps": 1e-6}, "AdamW's eps"
    assert actor.loss_agg_mode == "seq-mean-token-sum"


def test_a_kl_coef_becomes_verls_kl_loss_against_a_frozen_reference(model_dir: Path) -> None:
    trainer = {"batch_size": 4, "group_size": 3, "loss": "ppo", "kl_coef": 0.05}
    verl_config = composed(run_config(trainer=trainer), model_dir)
    actor = verl_config.actor_rollout_ref.actor
    assert actor.use_kl_loss and actor.kl_loss_coef == pytest.approx(0.05)
    assert actor.kl_loss_type == "low_var_kl", "the local backend's k3 estimator"
    reference = reference_worker_config(verl_config)
    assert reference is not None
    assert reference.engine_config.forward_only, "the reference never trains"
    assert reference.model_config.path == str(model_dir), "it starts from the policy's weights"
    assert reference.engine_config.infer_micro_batch_size_per_gpu == 8


def test_without_a_kl_coef_there_is_no_reference(model_dir: Path) -> None:
    verl_config = composed(run_config(), model_dir)
    assert not verl_config.actor_rollout_ref.actor.use_kl_loss
    assert reference_worker_config(verl_config) is None


def test_async_config_states_the_staleness_bound_in_verls_terms(model_dir: Path) -> None:
    config = run_config(mode="async", **{"async": {"max_staleness": 2}})
    v1 = composed(config, model_dir).trainer.v1
    assert v1.trainer_mode == "colocate_async"
    assert v1.sampler.max_off_policy_threshold == 2


def test_extra_overrides_apply_last(model_dir: Path) -> None:
    overrides = ["actor_rollout_ref.model.enable_gradient_checkpointing=True"]
    config = run_config(verl={"extra_overrides": overrides})
    assert composed(config, model_dir).actor_rollout_ref.model.enable_gradient_checkpointing


def test_a_key_verl_removed_is_refused_with_what_became_of_it(model_dir: Path) -> None:
    config = run_config(verl={"extra_overrides": ["trainer.use_legacy_worker_impl=disable"]})
    with pytest.raises(ConfigError, match=r"use_legacy_worker_impl.*removed in verl 0\.9"):
        composed(config, model_dir)


def test_a_key_verl_does_not_know_is_one_line_naming_it(model_dir: Path) -> None:
    config = run_config(verl={"extra_overrides": ["actor_rollout_ref.actor.no_such_knob=1"]})
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.no_such_knob") as caught:
        composed(config, model_dir)
    assert "\n" not in str(caught.value), "one line"


def test_verls_own_validation_runs(model_dir: Path) -> None:
    # verl refuses the deprecated micro-batch key beside the per-GPU one unified sets.
    config = run_config(
        verl={"extra_overrides": ["actor_rollout_ref.actor.ppo_micro_batch_size=2"]}
    )
    with pytest.raises(ConfigError, match="verl's config validation failed") as caught:
        composed(config, model_dir)
    assert "\n" not in str(caught.value) and "ppo_micro_batch_size" in str(caught.value)


def test_a_check_of_verls_model_config_that_fails_is_one_line(model_dir: Path) -> None:
    overrides = ["actor_rollout_ref.model.tokenizer_path=/no/such/tokenizer"]
    config = composed(run_config(verl={"extra_overrides": overrides}), model_dir)
    with pytest.raises(ConfigError, match="verl's config validation failed") as caught:
        training_worker_config(config)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("data.train_batch_size=3", r"data\.train_batch_size would have no effect"),
        ("algorithm.adv_estimator=rloo", r"algorithm\.adv_estimator would have no effect"),
        ("actor_rollout_ref.actor.ppo_epochs=2", r"ppo_epochs is unified's to set: the trainer"),
        (
            "+actor_rollout_ref.actor.optim.lr=1e-3",
            r"optim\.lr is unified's to set: use trainer\.lr",
        ),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps=5", r"use trainer\.lr_schedule"),
        ("actor_rollout_ref.actor.optim={lr:0.1}", r"optim would replace keys unified sets"),
    ],
)
def test_an_override_the_workers_never_see_or_unified_sets_is_refused(
    override: str, says: str
) -> None:
    """verl's validation accepts them; with unified's loop they did nothing, silently."""
    with pytest.raises(ConfigError, match=rf"verl\.extra_overrides.*{says}"):
        parse_verl_config(run_config(verl={"extra_overrides": [override]}))


def test_a_misspelt_verl_section_key_names_it() -> None:
    with pytest.raises(ConfigError, match=r"verl\.num_worker"):
        parse_verl_config(run_config(verl={"num_worker": 2}))
