"""Tinker's `dro` and `gspo` on the local server, against a direct computation of the documented
formulas; `stable_reinforce` is refused with its reason, through the real SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch

from tinker_server.server import LocalServer
from tinker_server.training import LoraSpec, TrainingModel
from tinker_server.wire import WireDatum
from torchkit.builtin import load_policy

DEADLINE_S = 60
LENGTHS = (6, 4)


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    model, _ = load_policy("builtin:tiny")
    return model


def trained(base: torch.nn.Module) -> TrainingModel:
    """A model whose adapters are not zero, so every gradient is informative."""
    model = TrainingModel(base, LoraSpec(rank=4, seed=3))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, param in model.parameters.items():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def data(with_mask: bool) -> list[WireDatum]:
    rng = np.random.default_rng(0)
    out = []
    for n in LENGTHS:
        old = np.where(np.arange(n) >= 2, rng.uniform(-3, -0.5, n), 0.0).astype(np.float32)
        inputs = {
            "target_tokens": rng.integers(3, 30, n).astype(np.int64),
            "logprobs": old,
            "advantages": np.where(old != 0, rng.normal(0, 1, n), 0.0).astype(np.float32),
        }
        if with_mask:
            inputs["sequence_ratio_mask"] = (old != 0).astype(np.float32)
        out.append(WireDatum(tokens=rng.integers(3, 30, n).astype(np.int64), inputs=inputs))
    return out


def direct(loss_fn: str, model: TrainingModel, batch: list[WireDatum], config: dict) -> float:
    """The documented formula, written out per datum; gradients into `model`."""
    logp_T = model._target_logprobs(batch)
    total = torch.zeros(())
    for datum, logp in zip(batch, torch.split(logp_T, list(LENGTHS)), strict=True):
        q = torch.from_numpy(datum.inputs["logprobs"])
        adv = torch.from_numpy(datum.inputs["advantages"])
        if loss_fn == "dro":
            beta = config["beta"]
            total = total - (logp * adv - 0.5 * beta * (logp - q) ** 2).sum()
        else:
            in_ratio = torch.from_numpy(datum.inputs["sequence_ratio_mask"]) != 0
            log_ratio = (logp.detach() - q)[in_ratio].mean()
            ratio = torch.exp(log_ratio + logp - logp.detach())
            low = config.get("clip_low_threshold", 0.8)
            high = config.get("clip_high_threshold", 1.2)
            clipped = torch.clamp(ratio, low, high)
            total = total - torch.minimum(ratio * adv, clipped * adv).sum()
    total.backward()  # type: ignore[no-untyped-call]
    return float(total.detach())


@pytest.mark.parametrize(
    ("loss_fn", "config", "with_mask"),
    [
        ("dro", {"beta": 0.05}, False),
        ("dro", {"beta": 1.0}, False),
        ("gspo", {}, True),
        ("gspo", {"clip_low_threshold": 0.999, "clip_high_threshold": 1.0005}, True),
        ("gspo", {}, False),  # the mask defaults to the positions with a sampler logprob
    ],
)
def test_loss_and_gradients_match_the_documented_formula(
    base: torch.nn.Module, loss_fn: str, config: dict, with_mask: bool
) -> None:
    served, reference = trained(base), trained(base)
    batch = data(with_mask)
    _, metrics = served.forward_backward(batch, loss_fn, config, forward_only=False)
    expected = direct(loss_fn, reference, data(with_mask=True), config)
    assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for name, param in served.parameters.items():
        theirs = reference.parameters[name].grad
        assert param.grad is not None and theirs is not None, name
        torch.testing.assert_close(param.grad, theirs, rtol=1e-4, atol=1e-7)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tinker.ServiceClient]:
    with LocalServer("builtin:tiny", store=tmp_path) as url:
        client = tinker.ServiceClient(base_url=url, api_key="tml-test")
        yield client
        client.close("success").result(DEADLINE_S)


def rl_datum() -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={
            "target_tokens": [6, 7, 8, 9],
            "logprobs": [0.0, 0.0, -1.0, -2.0],
            "advantages": [0.0, 0.0, 1.0, 1.0],
        },
    )


def test_dro_and_gspo_through_the_sdk(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client("builtin:tiny", rank=4).result(DEADLINE_S)
    for loss_fn, config in (("dro", {"beta": 0.1}), ("gspo", None)):
        out = tc.forward_backward([rl_datum()], loss_fn, config).result(DEADLINE_S)
        assert np.isfinite(out.metrics["loss:sum"]), loss_fn
        assert out.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (4,)
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_config"):
        tc.forward_backward([rl_datum()], "dro").result(DEADLINE_S)


def test_stable_reinforce_is_refused_with_its_reason(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client("builtin:tiny", rank=4).result(DEADLINE_S)
    with pytest.raises(tinker.RequestFailedError, match="objective is not published"):
        tc.forward_backward([rl_datum()], "stable_reinforce").result(DEADLINE_S)


def test_soft_target_cross_entropy_is_refused_in_one_line(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client("builtin:tiny", rank=4).result(DEADLINE_S)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={
            "target_tokens": np.array([[6, 9], [7, 9], [8, 9]], dtype=np.int64),
            "weights": np.full((3, 2), 0.5, dtype=np.float32),
        },
    )
    with pytest.raises(tinker.RequestFailedError, match="soft-target"):
        tc.forward_backward([datum], "cross_entropy").result(DEADLINE_S)
