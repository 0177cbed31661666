"""The unmodified tinker SDK against the local Tinker server: sampling, training, saved state."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker

from backends.tinker.server_process import ServerProcess
from tinker_server.faults import Faults
from tinker_server.server import LocalServer, main
from unified.errors import UsageError

DEADLINE_S = 60
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalServer]:
    """A local server on a free loopback port with its own store."""
    served = LocalServer("builtin:tiny", store=tmp_path / "store")
    served.start(timeout_s=DEADLINE_S)
    yield served
    served.stop()


@pytest.fixture
def service(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    yield client
    client.close("success").result(timeout=DEADLINE_S)


def training_client(service: tinker.ServiceClient, rank: int = 8) -> tinker.TrainingClient:
    return service.create_lora_training_client("builtin:tiny", rank=rank).result(DEADLINE_S)


def sample(client: tinker.SamplingClient, n: int = 4, seed: int = 1) -> tinker.SampleResponse:
    params = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
    prompt = tinker.ModelInput.from_ints(PROMPT)
    return client.sample(prompt, num_samples=n, sampling_params=params).result(DEADLINE_S)


def rl_datum(seq: tinker.SampledSequence, advantage: float) -> tinker.Datum:
    """Shift by one: input prompt + completion[:-1], targets prompt[1:] + completion."""
    tokens, n = list(seq.tokens), len(PROMPT) - 1
    assert seq.logprobs is not None
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(PROMPT + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": PROMPT[1:] + tokens,
            "logprobs": [0.0] * n + list(seq.logprobs),
            "advantages": [0.0] * n + [advantage] * len(tokens),
        },
    )


def completion_logprobs(tc: tinker.TrainingClient, datums: list[tinker.Datum]) -> np.ndarray:
    """The trainer's logprobs of every completion token, recomputed by `forward`."""
    out = tc.forward(datums, "importance_sampling").result(DEADLINE_S)
    n = len(PROMPT) - 1
    return np.concatenate([o["logprobs"].to_numpy()[n:] for o in out.loss_fn_outputs])


def test_installed_sdk_is_the_pinned_version() -> None:
    assert version("tinker") == "0.38.0", "pyproject pins tinker==0.38.0; the server speaks it"


def test_sampling_shapes_and_logprobs_match_the_trainers(service: tinker.ServiceClient) -> None:
    tc = training_client(service)
    response = sample(tc.save_weights_and_get_sampling_client().result(DEADLINE_S), n=4)
    assert len(response.sequences) == 4, "one sequence per requested sample"
    for seq in response.sequences:
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens) > 0
        assert seq.stop_reason in ("stop", "length")
    sampled = np.concatenate([np.asarray(s.logprobs) for s in response.sequences])
    recomputed = completion_logprobs(tc, [rl_datum(s, 0.0) for s in response.sequences])
    gap = float(np.abs(recomputed - sampled).max())
    assert gap <= 1e-5, f"sampler and trainer logprobs differ by {gap}"


def test_a_positive_advantage_raises_the_sequences_logprob(service: tinker.ServiceClient) -> None:
    tc = training_client(service)
    seq = sample(tc.save_weights_and_get_sampling_client().result(DEADLINE_S), n=1).sequences[0]
    datum = rl_datum(seq, 1.0)
    before = completion_logprobs(tc, [datum]).sum()
    backward = tc.forward_backward([datum], "importance_sampling")
    step = tc.optim_step(tinker.AdamParams(learning_rate=1e-2))
    backward.result(DEADLINE_S), step.result(DEADLINE_S)
    after = completion_logprobs(tc, [datum]).sum()
    assert after > before + 0.1, f"logprob of the rewarded sequence went {before} -> {after}"
    fresh = tc.save_weights_and_get_sampling_client().result(DEADLINE_S)
    response = sample(fresh, n=1, seed=123)
    recomputed = completion_logprobs(tc, [rl_datum(response.sequences[0], 0.0)])
    assert response.sequences[0].logprobs is not None
    gap = float(np.abs(recomputed - np.asarray(response.sequences[0].logprobs)).max())
    assert gap <= 1e-5, f"after training, the merged-adapter sampler is {gap} off the trainer"


def test_a_client_restored_from_saved_state_continues_identically(
    service: tinker.ServiceClient,
) -> None:
    tc = training_client(service)
    seq = sample(tc.save_weights_and_get_sampling_client().result(DEADLINE_S), n=1).sequences[0]
    datum = rl_datum(seq, 1.0)
    adam = tinker.AdamParams(learning_rate=1e-2)
    tc.forward_backward([datum], "ppo").result(DEADLINE_S)
    tc.optim_step(adam).result(DEADLINE_S)
    path = tc.save_state("after-one-step").result(DEADLINE_S).path
    assert path.startswith("tinker://"), path
    restored = service.create_training_client_from_state_with_optimizer(path).result(DEADLINE_S)
    assert restored.get_info().lora_rank == 8, "the restored model keeps its LoRA rank"
    np.testing.assert_array_equal(
        completion_logprobs(restored, [datum]), completion_logprobs(tc, [datum])
    )
    for client in (tc, restored):  # the same second step: equal only if Adam's state came back
        client.forward_backward([datum], "ppo").result(DEADLINE_S)
        client.optim_step(adam).result(DEADLINE_S)
    np.testing.assert_allclose(
        completion_logprobs(restored, [datum]), completion_logprobs(tc, [datum]), atol=1e-6
    )


def test_a_finished_session_frees_its_models_and_one_runs_syncs_keep_anothers_sampler(
    server: LocalServer,
) -> None:
    """The real service keeps a session's samplers until it ends; the local server, shared by
    runs (`unified tinker-serve`), must neither expire one run's sampler for another's syncs
    nor keep every finished run's models."""
    first = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    second = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    current = training_client(first).save_weights_and_get_sampling_client().result(DEADLINE_S)
    other = training_client(second)
    for _ in range(server.service.keep_samplers + 1):
        other.save_weights_and_get_sampling_client().result(DEADLINE_S)
    assert len(sample(current, n=1).sequences[0].tokens) == 8, "the first run still samples"
    first.close("success").result(timeout=DEADLINE_S)
    second.close("success").result(timeout=DEADLINE_S)
    assert server.service.models == {}
    assert server.service.pool.max_positions is not None and not server.service.pool._owner


def test_an_unknown_loss_input_is_a_clear_request_error(service: tinker.ServiceClient) -> None:
    tc = training_client(service)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(PROMPT),
        loss_fn_inputs={
            "target_tokens": PROMPT,
            "weights": [1.0] * 5,
            "mask": np.ones(5, np.float32),  # the cookbook's key, which must never be sent
        },
    )
    with pytest.raises(tinker.RequestFailedError, match="takes loss_fn_inputs"):
        tc.forward_backward([datum], "cross_entropy").result(DEADLINE_S)


def test_an_error_future_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    faults = Faults(error_future_rate=1.0, error_future_paths=frozenset({"/api/v1/optim_step"}))
    with LocalServer("builtin:tiny", store=tmp_path, faults=faults) as url:
        client = tinker.ServiceClient(base_url=url, api_key="tml-test")
        tc = training_client(client)
        with pytest.raises(tinker.RequestFailedError, match="injected error future"):
            tc.optim_step(tinker.AdamParams()).result(DEADLINE_S)
        client.close("errored").result(DEADLINE_S)


def test_a_result_not_ready_within_the_long_poll_is_polled_again_without_a_warning(
    server: LocalServer, service: tinker.ServiceClient, caplog: pytest.LogCaptureFixture
) -> None:
    server.app.state.futures.poll_s = 0.0  # every poll before the result ends in try_again
    tc = training_client(service)
    with caplog.at_level(logging.WARNING, logger="tinker"):
        out = sample(tc.save_weights_and_get_sampling_client().result(DEADLINE_S))
    assert len(out.sequences) == 4
    assert not [r for r in caplog.records if "try_again" in r.getMessage()]


def test_a_wrong_key_is_refused(tmp_path: Path) -> None:
    with LocalServer("builtin:tiny", store=tmp_path, api_key="tml-right") as url:
        client = tinker.ServiceClient(base_url=url, api_key="tml-wrong")
        with pytest.raises(tinker.AuthenticationError, match="invalid or missing API key"):
            client.create_lora_training_client("builtin:tiny", rank=8).result(DEADLINE_S)


async def test_the_server_process_serves_until_its_stdin_closes(tmp_path: Path) -> None:
    server = ServerProcess("builtin:tiny", store=tmp_path / "store")
    url = await server.start(timeout_s=120)
    process = server._process
    assert process is not None and process.stdin is not None
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        health = await client.get(f"{url}/api/v1/healthz")
    assert health.json() == {"status": "ok"}, health.text
    # What a trainer that dies does: its end of the pipe closes.
    process.stdin.close()
    async with asyncio.timeout(DEADLINE_S):
        code = await process.wait()
    assert code == 0, f"the server exited with {code} when its stdin closed"
    await server.stop()


async def test_stop_ends_the_server_in_order_and_a_terminal_ctrl_c_does_not_reach_it(
    tmp_path: Path,
) -> None:
    server = ServerProcess("builtin:tiny", store=tmp_path / "store")
    await server.start(timeout_s=120)
    process = server._process
    assert process is not None
    # Ctrl-C goes to the terminal's process group: the trainer's, not the server's.
    assert os.getpgid(process.pid) != os.getpgid(0)
    await server.stop(timeout_s=DEADLINE_S)
    assert process.returncode == 0, "stopped by its stdin closing, not killed"


async def test_a_hung_server_process_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """A vLLM engine process left behind by a dying server holds its stdout open: stop() must
    still return, and take that process along (the child's own process group)."""
    pid_file = tmp_path / "grandchild.pid"
    hung = (
        "import subprocess, sys, time; "
        "started = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(started.pid)); "
        "print('tinker-serve: fake at http://127.0.0.1:1 (hung)', flush=True); time.sleep(600)"
    )
    server = ServerProcess("builtin:tiny", store=tmp_path / "store")
    server.args = ["-c", hung]  # ignores its stdin closing, like a server stuck loading
    await server.start(timeout_s=DEADLINE_S)
    process = server._process
    assert process is not None
    async with asyncio.timeout(DEADLINE_S):
        await server.stop(timeout_s=1)
    assert process.returncode is not None, "the child was killed"
    assert await ended(int(pid_file.read_text())), "the process the child started was killed"


async def ended(pid: int) -> bool:
    """Whether process `pid` ends (or is a zombie) within a few seconds."""
    for _ in range(100):
        if not running(pid):
            return True
        await asyncio.sleep(0.05)
    return False


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_a_server_process_that_cannot_load_its_model_is_one_clear_error(
    tmp_path: Path,
) -> None:
    server = ServerProcess(str(tmp_path / "no-such-model"), store=tmp_path / "store")
    with pytest.raises(UsageError, match="the local Tinker server failed to start"):
        await server.start(timeout_s=120)


async def test_tinker_serve_serves_the_directory_a_model_provider_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "provided"
    monkeypatch.setenv("UNIFIED_TEST_MODEL_DIR", str(model_dir))
    server = ServerProcess("tests.model_providers:tiny_policy", store=tmp_path / "store")
    url = await server.start(timeout_s=120)
    try:
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            served = await client.get(f"{url}/api/v1/get_server_capabilities")
    finally:
        await server.stop()
    assert served.json() == {"supported_models": [{"model_name": str(model_dir)}]}, served.text


def test_tinker_serve_with_a_failing_model_provider_is_one_clear_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["--port", "0", "--model", "tests.model_providers:broken_model"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model provider 'tests.model_providers:broken_model' failed: RuntimeError" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--faults", "{bad"], "--faults is not JSON"),
        (["--faults", '{"nope": 1}'], "--faults: nope: Extra inputs are not permitted"),
        (["--max-batch", "0"], "argument --max-batch: must be at least 1, got 0"),
        (["--keep-samplers", "0"], "argument --keep-samplers: must be at least 1, got 0"),
        (["--engine", "gpu"], "argument --engine: invalid choice: 'gpu'"),
        (["--vllm", "{}"], "--vllm sets the vLLM engine: add --engine vllm"),
        (["--engine", "vllm", "--vllm", "{bad"], "--vllm is not JSON"),
        (
            ["--engine", "vllm", "--vllm", '{"kv_cache_gb": 0}'],
            "--vllm: kv_cache_gb: Input should be greater than 0",
        ),
    ],
)
def test_tinker_serve_refuses_bad_arguments_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main([*argv, "--port", "0"])
    except SystemExit as e:  # argparse's own errors
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_tinker_serve_on_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
