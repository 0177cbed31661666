"""Tinker's `dro`, `gspo` and soft-target `cross_entropy` on the local server, against a direct
computation of the documented formulas; `stable_reinforce` is refused with its reason, and a
malformed soft target with one line naming the fix, through the real SDK."""

from __future__ import annotations

import copy
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
    logp_T = torch.cat(model._target_logprobs(batch))
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


def soft_datum(n: int, k: int, seed: int) -> tinker.Datum:
    """`n` positions, each with `k` target tokens weighted by a random distribution; position 0
    weighs nothing (a prompt position), as tinker-cookbook's distillation datums do."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(k), n).astype(np.float32)
    weights[0] = 0.0
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(rng.integers(3, 100, n).tolist()),
        loss_fn_inputs={"target_tokens": rng.integers(3, 100, (n, k)), "weights": weights},
    )


def direct_cross_entropy(model: TrainingModel, batch: list[tinker.Datum]) -> list[torch.Tensor]:
    """`-sum(weights * logp(target_tokens))` per datum, written out with the model's own forward
    pass; gradients into `model`. Each datum's logprobs, shaped as its `target_tokens`."""
    total, logprobs = torch.zeros(()), []
    for datum in batch:
        ids = torch.tensor(datum.model_input.to_ints())[None]
        logp_NV = torch.log_softmax(model.model(input_ids=ids).logits[0].float(), -1)
        targets = datum.loss_fn_inputs["target_tokens"].to_torch()
        logp = logp_NV.gather(1, targets.reshape(len(targets), -1)).reshape(targets.shape)
        total = total - (datum.loss_fn_inputs["weights"].to_torch() * logp).sum()
        logprobs.append(logp.detach())
    total.backward()  # type: ignore[no-untyped-call]
    return [*logprobs, total.detach()]


def test_soft_target_cross_entropy_matches_torch_through_the_sdk(tmp_path: Path) -> None:
    server = LocalServer("builtin:tiny", store=tmp_path)
    with server as url:
        service = tinker.ServiceClient(base_url=url, api_key="tml-test")
        tc = service.create_lora_training_client("builtin:tiny", rank=4).result(DEADLINE_S)
        # One step first, so no adapter is zero and every gradient is informative.
        tc.forward_backward([soft_datum(6, 3, seed=9)], "cross_entropy").result(DEADLINE_S)
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result(DEADLINE_S)
        served = server.service.models[tc.model_id].training
        reference = copy.deepcopy(served)
        hard = tinker.Datum(
            model_input=tinker.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 1.0]},
        )
        # Two values of K and a one-target datum in one call, as the SDK allows.
        batch = [soft_datum(5, 4, seed=1), soft_datum(7, 2, seed=2), hard]
        out = tc.forward_backward(batch, "cross_entropy").result(DEADLINE_S)
        service.close("success").result(DEADLINE_S)

    *expected, loss = direct_cross_entropy(reference, batch)
    assert out.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-5)
    for i, (output, want) in enumerate(zip(out.loss_fn_outputs, expected, strict=True)):
        got = output["logprobs"].to_torch()
        assert got.shape == want.shape, f"datum {i}: logprobs shaped as its target_tokens"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, param in served.parameters.items():
        theirs = reference.parameters[name].grad
        assert param.grad is not None and theirs is not None, name
        scale = float(theirs.abs().max())
        assert scale > 1e-4, f"{name}: an informative gradient"
        # The server scores the batch padded (masked attention), the direct computation one
        # datum at a time: float32 rounding differs, far below a wrong weight's error.
        torch.testing.assert_close(param.grad, theirs, rtol=1e-4, atol=1e-4 * scale)


@pytest.fixture(scope="module")
def training_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.TrainingClient]:
    """One training model on one server, for the tests that only read answers."""
    with LocalServer("builtin:tiny", store=tmp_path_factory.mktemp("store")) as url:
        service = tinker.ServiceClient(base_url=url, api_key="tml-test")
        yield service.create_lora_training_client("builtin:tiny", rank=4).result(DEADLINE_S)
        service.close("success").result(DEADLINE_S)


def test_sparse_soft_targets_score_as_their_dense_form(
    training_client: tinker.TrainingClient,
) -> None:
    """The SDK sends a mostly-zero 2-D torch `target_tokens` or `weights` as CSR."""
    source = soft_datum(6, 5, seed=4)
    weights = source.loss_fn_inputs["weights"].to_torch()
    weights[:4] = 0.0  # four prompt positions: no targets
    targets = source.loss_fn_inputs["target_tokens"].to_torch()
    targets[:4] = 0
    sparse = tinker.Datum(
        model_input=source.model_input,
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    assert sparse.loss_fn_inputs["weights"].sparse_crow_indices is not None, "sent as CSR"
    assert sparse.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None, "sent as CSR"
    dense = tinker.Datum(
        model_input=source.model_input,
        loss_fn_inputs={"target_tokens": targets.numpy(), "weights": weights.numpy()},
    )
    got = training_client.forward([sparse], "cross_entropy").result(DEADLINE_S)
    want = training_client.forward([dense], "cross_entropy").result(DEADLINE_S)
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
    np.testing.assert_array_equal(
        got.loss_fn_outputs[0]["logprobs"].to_numpy(),
        want.loss_fn_outputs[0]["logprobs"].to_numpy(),
    )


def test_a_custom_loss_over_soft_targets_sees_their_logprobs(
    training_client: tinker.TrainingClient,
) -> None:
    """`forward_backward_custom` with `(N, K)` targets, as the SDK's docstring shows (and the
    cookbook's reverse-KL distillation uses): the loss gets `(N, K)` logprobs, and its gradient
    goes back as `(N, K)` weights."""
    datum = soft_datum(5, 3, seed=6)
    shapes: list[tuple[int, ...]] = []

    def weighted(
        data: list[tinker.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        shapes.extend(tuple(lp.shape) for lp in logprobs)
        loss = sum(
            (
                -(d.loss_fn_inputs["weights"].to_torch() * lp).sum()
                for d, lp in zip(data, logprobs, strict=True)
            ),
            torch.zeros(()),
        )
        return loss, {}

    custom = training_client.forward_backward_custom([datum], weighted).result(DEADLINE_S)
    served = training_client.forward([datum], "cross_entropy").result(DEADLINE_S)
    assert shapes == [(5, 3)], shapes
    assert custom.metrics["loss:sum"] == pytest.approx(served.metrics["loss:sum"], rel=1e-5)
    # The surrogate backward is cross_entropy with weights -dC/dlogp = the datum's weights.
    assert custom.metrics["surrogate_loss:sum"] == pytest.approx(
        served.metrics["loss:sum"], rel=1e-5
    )


def with_inputs(n: int, **inputs: object) -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(list(range(5, 5 + n))),
        loss_fn_inputs=inputs,  # type: ignore[arg-type]
    )


def csr(
    shape: list[int], crow: list[int], col: list[int], values: list[float]
) -> tinker.TensorData:
    return tinker.TensorData(
        data=values,
        dtype="float32",
        shape=shape,
        sparse_crow_indices=crow,
        sparse_col_indices=col,
    )


TARGETS_32 = np.full((3, 2), 9)
WEIGHTS_32 = np.full((3, 2), 0.5, dtype=np.float32)


@pytest.mark.parametrize(
    ("loss_fn", "datum", "message"),
    [
        (
            "cross_entropy",
            with_inputs(3, target_tokens=TARGETS_32, weights=np.full((3, 3), 0.5, np.float32)),
            r"shapes differ, target_tokens \(3, 2\) vs weights \(3, 3\); send both \(N,\) or both",
        ),
        (
            "cross_entropy",
            with_inputs(3, target_tokens=TARGETS_32, weights=[1.0, 1.0, 1.0]),
            r"shapes differ, target_tokens \(3, 2\) vs weights \(3,\)",
        ),
        (
            "cross_entropy",
            with_inputs(3, target_tokens=np.full((3, 2, 1), 9), weights=WEIGHTS_32),
            r"has shape \[3, 2, 1\]: 3-D inputs are not served; send one value per position",
        ),
        (
            "cross_entropy",
            with_inputs(4, target_tokens=TARGETS_32, weights=WEIGHTS_32),
            r"has shape \(3, 2\) for 4 input tokens; its first dimension must be 4",
        ),
        (
            "cross_entropy",
            with_inputs(3, target_tokens=np.zeros((3, 0), np.int64), weights=np.zeros((3, 0))),
            r"have K = 0; send at least one target per position",
        ),
        (
            "cross_entropy",
            with_inputs(3, target_tokens=np.full((3, 2), 10**6), weights=WEIGHTS_32),
            r"target_tokens holds 1000000, outside the model's vocabulary",
        ),
        (
            "cross_entropy",
            with_inputs(3, target_tokens=TARGETS_32, weights=csr([3, 2], [0, 1], [0], [1.0])),
            r"'weights'\] is not a valid CSR tensor of shape \[3, 2\]",
        ),
        (
            "cross_entropy",
            with_inputs(3, target_tokens=[6, 7, 8], weights=csr([3], [0, 1], [0], [1.0])),
            r"sparse tensors must be 2-D \(N, K\)",
        ),
        (
            "importance_sampling",
            with_inputs(
                3,
                target_tokens=[6, 7, 8],
                logprobs=[-1.0, -1.0, -1.0],
                advantages=np.ones((3, 2), np.float32),
            ),
            r"'advantages'\] has shape \(3, 2\); loss 'importance_sampling' takes no \(N, K\)",
        ),
    ],
    ids=[
        "K differs",
        "2-D targets, 1-D weights",
        "3-D",
        "N differs from the input",
        "K is 0",
        "outside the vocabulary",
        "malformed CSR",
        "1-D CSR",
        "2-D advantages",
    ],
)
def test_a_malformed_soft_target_is_refused_in_one_line_naming_the_fix(
    training_client: tinker.TrainingClient, loss_fn: str, datum: tinker.Datum, message: str
) -> None:
    with pytest.raises(tinker.RequestFailedError, match=message) as refused:
        training_client.forward_backward([datum], loss_fn).result(DEADLINE_S)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value), f"one line: {refused.value}"
