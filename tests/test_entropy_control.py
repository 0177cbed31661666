"""Adaptive entropy control (`trainer.entropy_target`): the coefficient each step trains with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ConfigFactory
from tests.test_local_backend import PROMPTS, group_of, local_config, sample, started
from unified import UnifiedTrainer
from unified.config import load_config
from unified.errors import CapabilityError, ConfigError
from unified.protocol import BackendCapabilities
from unified.schedule import EntropyControl
from unified.testing import BanditBackend, bandit_tasks


def control(**trainer: Any) -> EntropyControl:
    config = load_config({"workflow": "unified.testing:BanditWorkflow", "trainer": trainer})
    return EntropyControl(config.trainer)


def coefficients(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["train/entropy_coef"] for line in lines if "train/entropy_coef" in line]


def test_the_coefficient_moves_toward_the_target_within_its_bounds() -> None:
    c = control(
        entropy_target=0.3, entropy_coef=0.01, entropy_coef_step=0.02, entropy_coef_max=0.05
    )
    assert [c.update(0.1) for _ in range(3)] == pytest.approx([0.03, 0.05, 0.05]), "capped at max"
    assert c.update(None) == pytest.approx(0.05), "a step with no entropy leaves it"
    assert c.update(float("nan")) == pytest.approx(0.05)
    assert [c.update(0.9) for _ in range(4)] == pytest.approx([0.03, 0.01, 0.0, 0.0]), "floor 0"
    fixed = control(entropy_coef=0.02)
    assert not fixed.adaptive and fixed.update(0.0) == 0.02, "no target: the coefficient stays"


def test_each_step_logs_the_coefficient_it_trained_with_and_the_backend_gets_the_next(
    make_config: ConfigFactory,
) -> None:
    # The bandit's entropy starts at log 4 (1.39 nats): a target above it only ever raises.
    trainer = {"entropy_target": 2.0, "entropy_coef": 0.1, "entropy_coef_step": 0.05}
    backend = BanditBackend()
    run_dir = (
        UnifiedTrainer(make_config(trainer=trainer), backend=backend, train_tasks=bandit_tasks(24))
        .fit()
        .run_dir
    )
    assert coefficients(run_dir) == pytest.approx([0.1, 0.15, 0.2, 0.25])
    sets = [event[1] for event in backend.events if event[0] == "set_entropy_coef"]
    assert sets == pytest.approx([0.1, 0.15, 0.2, 0.25, 0.3]), "before step 1, then after each"
    first = backend.events.index(("set_entropy_coef", 0.1))
    assert first < next(i for i, e in enumerate(backend.events) if e[0] == "forward_backward")


def test_a_target_under_the_entropy_lowers_the_coefficient_to_zero(
    make_config: ConfigFactory,
) -> None:
    trainer = {"entropy_target": 0.01, "entropy_coef": 0.1, "entropy_coef_step": 0.04}
    config = make_config(trainer=trainer)
    result = UnifiedTrainer(config, backend=BanditBackend(), train_tasks=bandit_tasks(24)).fit()
    assert coefficients(result.run_dir) == pytest.approx([0.1, 0.06, 0.02, 0.0])


def test_a_resumed_run_continues_from_the_saved_coefficient(make_config: ConfigFactory) -> None:
    trainer = {"entropy_target": 2.0, "entropy_coef": 0.0, "entropy_coef_step": 0.1}
    first = make_config(name="resumed", trainer={**trainer, "total_steps": 3, "save_every": 3})
    UnifiedTrainer(first, backend=BanditBackend(), train_tasks=bandit_tasks(24)).fit()
    second = make_config(
        name="resumed", resume=True, trainer={**trainer, "total_steps": 5, "save_every": 3}
    )
    backend = BanditBackend()
    result = UnifiedTrainer(second, backend=backend, train_tasks=bandit_tasks(24)).fit()
    assert coefficients(result.run_dir) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert backend.events[0] == ("set_entropy_coef", pytest.approx(0.3)), backend.events[:2]


def test_a_backend_with_a_fixed_coefficient_refuses_a_target_in_one_line(
    make_config: ConfigFactory,
) -> None:
    config = make_config(trainer={"entropy_target": 0.2})
    backend = BanditBackend(capabilities=BackendCapabilities())
    with pytest.raises(CapabilityError) as refused:
        UnifiedTrainer(config, backend=backend, train_tasks=bandit_tasks(24)).fit()
    message = str(refused.value)
    assert "trainer.entropy_target=0.2" in message and "set trainer.entropy_target=null" in message
    assert "\n" not in message


def test_a_starting_coefficient_over_the_cap_is_one_line(make_config: ConfigFactory) -> None:
    config = make_config(trainer={"entropy_target": 0.2, "entropy_coef": 0.6})
    with pytest.raises(
        ConfigError, match=r"trainer.entropy_coef \(0.6\) .* <= trainer.entropy_coef_max \(0.5\)"
    ):
        load_config(config)


async def test_the_local_backend_weighs_the_bonus_by_the_coefficient_it_was_given() -> None:
    backend = await started(local_config(entropy_coef=0.0, kl_coef=0.0))
    outs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS[:2])]
    group = group_of(outs, [1.0, -1.0])
    without = await backend.forward_backward([group])
    backend.set_entropy_coef(0.5)
    with_bonus = await backend.forward_backward([group])
    await backend.shutdown()
    expected = without["train/loss"] - 0.5 * without["train/entropy"]  # token mean of both
    assert with_bonus["train/loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
