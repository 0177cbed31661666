"""TinkerBackend through the real SDK and the local server: training, sync, resume, failures."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.tinker.backend import TinkerBackend
from backends.tinker.config import TinkerConfig
from examples.countdown.prepare import WarmStartRecipe, ensure_warmstart
from tests.conftest import ConfigFactory
from tinker_server.faults import Faults
from tinker_server.server import LocalServer
from unified import UnifiedTrainer
from unified.cli import main
from unified.config import load_config
from unified.errors import BackendError, ConfigError, UsageError
from unified.evaluation import run_eval
from unified.rollout import SamplingEngine
from unified.sequences import sequences_of
from unified.testing import digits_tasks
from unified.types import Episode, ModelOutput, Step, Trajectory, TrajectoryGroup

KEY = "tml-test"
# At 5e-3 the LoRA updates overshoot: one seed's greedy eval went 0.22 -> 0.42 -> 0.27 -> 0.16 over
# 12 steps. At 2e-3 seeds 0-2 rose to 0.49-0.55 by step 8 in sync and async alike.
COUNTDOWN_LR = 2e-3
COUNTDOWN_GAIN = 0.1  # measured at step 8: +0.27 to +0.33 (0.224 -> 0.49-0.56)


@pytest.fixture
def tinker_config(make_config: ConfigFactory) -> Any:
    """A config factory for the tinker backend with the digits workflow."""

    def make(base_url: str | None = None, **sections: Any) -> dict[str, Any]:
        # A request waits behind the server's batch and its training step: generous deadlines.
        trainer = {
            "batch_size": 4, "group_size": 4, "lr": 1e-2, "stall_timeout_s": 300,
            "workflow_timeout_s": 120, **sections.pop("trainer", {}),
        }  # fmt: skip
        return make_config(
            backend="tinker",
            workflow=sections.pop("workflow", "unified.testing:DigitsWorkflow"),
            model=sections.pop("model", "builtin:tiny"),
            trainer=trainer,
            sampling={"train": {"max_tokens": 8}, **sections.pop("sampling", {})},
            tinker={"lora_rank": 8, "base_url": base_url, "request_timeout_s": 300},
            **sections,
        )

    return make


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    served = LocalServer("builtin:tiny", store=tmp_path / "store")
    served.start(timeout_s=60)
    yield served
    served.stop()


def rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reward_rises_when_training_through_tinker(
    mode: str, server: LocalServer, tinker_config: Any
) -> None:
    # 32 rollouts a step keep the curve steady; the policy can reach all-digit replies (every
    # group equal), so no group is filtered.
    trainer = {"total_steps": 6, "batch_size": 8, "filter_groups": False}
    # Staleness 0 keeps a 6-step curve steady (off-policy noise hides the rise at this batch);
    # requests running across a weight sync are tested below.
    config = tinker_config(server.base_url, mode=mode, trainer=trainer, async_={"max_staleness": 0})
    result = UnifiedTrainer(config, train_tasks=digits_tasks()).fit()
    curve = rewards(result.run_dir)
    assert result.steps == 6 and len(curve) == 6
    first, last = sum(curve[:3]) / 3, sum(curve[3:]) / 3
    assert last > first + 0.05, f"{mode}: reward did not rise: {curve}"
    assert "train/kl_sample_train" in result.metrics and "train/grad_norm" in result.metrics
    assert list(server.service.finished.values()) == ["success"], "the session says it succeeded"


@pytest.fixture(scope="module")
def countdown_warmstart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A countdown warm start small enough to build in seconds: two numbers up to 9, every
    example an expression (80 steps teach the format, not also the target)."""
    recipe = WarmStartRecipe(
        steps=80, batch_size=32, lr=5e-3, numbers=2, max_number=9, target_share=0.0
    )
    return ensure_warmstart(tmp_path_factory.mktemp("countdown") / "warmstart", recipe)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_countdown_reward_rises_through_tinker(
    mode: str, countdown_warmstart: Path, tinker_config: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    problems = {"generator": "examples.countdown.tasks:make_tasks", "numbers": 2, "max_number": 9}
    config = tinker_config(
        model=str(countdown_warmstart),
        mode=mode,
        workflow="examples.countdown.workflow:CountdownWorkflow",
        # Greedy evaluations of the same training problems before and after: a paired comparison
        # (the eval split holds too few problems of two numbers up to 9).
        data={"train": {**problems, "n": 100}, "eval": {**problems, "n": 48}},
        trainer={"total_steps": 8, "batch_size": 8, "group_size": 8, "lr": COUNTDOWN_LR,
                 "filter_groups": False, "eval_every": 8, "eval_before_train": True},
        async_={"max_staleness": 1},
        sampling={"train": {"max_tokens": 8}, "eval": {"temperature": 0.0, "max_tokens": 8}},
    )  # fmt: skip
    run_dir = UnifiedTrainer(config).fit().run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evals = [(r["step"], r["eval/reward"]) for r in rows if "eval/reward" in r]
    assert [step for step, _ in evals] == [0, 8], evals
    assert evals[1][1] > evals[0][1] + COUNTDOWN_GAIN, f"{mode}: eval reward did not rise: {evals}"
    if mode == "async":
        assert max(r.get("staleness/max", 0) for r in rows) >= 1, "async trained off-policy"
        assert sum(r.get("tokens/discarded", 0) for r in rows) == 0, "nothing thrown away"
        lags = [r["lag/token_max"] for r in rows if "lag/token_max" in r]
        assert lags and max(lags) >= 1, "each token's lag is reported"


@pytest.mark.parametrize(
    ("key", "section", "service"),
    [
        (None, {}, "offline"),
        ("tml-x", {}, "remote"),
        (None, {"base_url": "http://127.0.0.1:9"}, "remote"),
        ("tml-x", {"service": "offline"}, "offline"),
    ],
)
def test_the_service_a_run_trains_on_is_resolved_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, key: str | None, section: dict[str, Any], service: str
) -> None:
    if key is None:
        monkeypatch.delenv("TINKER_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TINKER_API_KEY", key)
    config = load_config({"workflow": "unified.testing:DigitsWorkflow", "tinker": section})
    resolved = TinkerBackend().resolve_config(config)
    assert resolved.tinker["service"] == service
    assert "tml-x" not in resolved.to_yaml(), "never the key"


def test_an_offline_service_with_a_base_url_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"tinker\.service: offline starts a local server"):
        TinkerConfig.from_section({"service": "offline", "base_url": "http://127.0.0.1:9"})


def test_without_url_or_key_the_backend_trains_on_its_own_local_server_and_resumes(
    tinker_config: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    config = tinker_config(trainer={"total_steps": 2, "save_every": 2})
    with caplog.at_level(logging.WARNING, logger="backends.tinker.backend"):
        first = UnifiedTrainer(config, train_tasks=digits_tasks()).fit()
    said = [r.getMessage() for r in caplog.records if "trains offline" in r.getMessage()]
    assert said and "TINKER_API_KEY=tml-" in said[0], "the offline fallback says so, and how out"
    recorded = yaml.safe_load((first.run_dir / "config.yaml").read_text())
    assert recorded["tinker"]["service"] == "offline", "and the run's config records it"
    (checkpoint,) = (first.run_dir / "checkpoints").iterdir()
    record = json.loads((checkpoint / "backend" / "tinker.json").read_text())
    assert record["state_path"].startswith("tinker://"), "the run records the tinker:// path"
    # A new process would start a new local server on the same store: so does this run.
    resumed = UnifiedTrainer(
        {**config, "resume": True, "trainer": {**config["trainer"], "total_steps": 4}},
        train_tasks=digits_tasks(),
    ).fit()
    steps = [json.loads(line)["step"] for line in (first.run_dir / "metrics.jsonl").open()]
    assert resumed.steps == 4 and steps == [1, 2, 3, 4], f"step count not continuous: {steps}"


def test_a_resume_or_eval_makes_the_policy_client_from_saved_state_only(
    server: LocalServer, tinker_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tinker cannot drop a client: a resume (or `unified eval` of a checkpoint) that first made
    a fresh policy client and then one from the checkpoint would keep an untrained model on the
    service all session."""
    made: list[str] = []
    create_model, load_weights = server.service.create_model, server.service.load_weights

    async def counted_create(request: dict[str, Any]) -> Any:
        made.append("fresh")
        return await create_model(request)

    async def counted_load(request: dict[str, Any]) -> Any:
        made.append("from state")
        return await load_weights(request)

    monkeypatch.setattr(server.service, "create_model", counted_create)
    monkeypatch.setattr(server.service, "load_weights", counted_load)
    config = tinker_config(server.base_url, trainer={"total_steps": 1, "save_every": 1})
    UnifiedTrainer(config, train_tasks=digits_tasks()).fit()
    fresh = made.count("fresh")  # the policy's, and the KL reference's if the run has one
    made.clear()
    resumed = {**config, "resume": True, "trainer": {**config["trainer"], "total_steps": 2}}
    run_dir = UnifiedTrainer(resumed, train_tasks=digits_tasks()).fit().run_dir
    assert made.count("from state") == 1 and made.count("fresh") == fresh - 1, made
    made.clear()
    evaluated = {
        **config,
        "data": {"eval": {"generator": "unified.testing:digits_tasks", "n": 4}},
    }
    metrics = asyncio.run(run_eval(load_config(evaluated), checkpoint=run_dir))
    assert metrics["eval/reward"] >= 0.0
    assert made.count("from state") == 1 and made.count("fresh") == fresh - 1, made


def test_injected_5xx_and_429_are_retried_and_training_completes(
    tmp_path: Path, tinker_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    faults = Faults(http_500_rate=0.15, http_429_rate=0.1, seed=3)
    server = LocalServer("builtin:tiny", store=tmp_path / "store", faults=faults)
    try:
        config = tinker_config(server.start(), trainer={"total_steps": 2})
        result = UnifiedTrainer(config, train_tasks=digits_tasks()).fit()
    finally:
        server.stop()
    assert server.injected["http_500"] > 0 and server.injected["http_429"] > 0, server.injected
    assert result.steps == 2, "training completed despite the injected failures"


def test_an_error_future_stops_training_with_a_clear_error(
    tmp_path: Path, tinker_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    faults = Faults(error_future_rate=1.0, error_future_paths=frozenset({"/api/v1/optim_step"}))
    served = LocalServer("builtin:tiny", store=tmp_path / "store", faults=faults)
    with served as url:
        config = tinker_config(url, trainer={"total_steps": 2})
        with pytest.raises(BackendError, match=r"optim_step failed.*injected error future"):
            UnifiedTrainer(config, train_tasks=digits_tasks()).fit()
    assert list(served.service.finished.values()) == ["errored"], "the session says it failed"


def test_a_wrong_key_is_one_clear_line(
    tmp_path: Path, tinker_config: Any, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("TINKER_API_KEY", "tml-wrong")
    with LocalServer("builtin:tiny", store=tmp_path / "store", api_key="tml-right") as url:
        # Any data: the key is refused at set-up, before a workflow runs.
        data = {"train": {"generator": "examples.countdown.tasks:make_tasks", "n": 8}}
        config = tinker_config(url, data=data)
        path = tmp_path / "run.yaml"
        path.write_text(json.dumps(config))
        code = main(["train", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "refused the API key in $TINKER_API_KEY (HTTP 401)" in err


def test_an_unreachable_server_is_one_clear_error(
    tinker_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    backend = TinkerBackend()
    config = load_config(tinker_config("http://127.0.0.1:9"))
    with pytest.raises(UsageError, match=r"cannot reach http://127.0.0.1:9"):
        asyncio.run(backend.setup(config))
    # With a key and no tinker.base_url, where the SDK would go ($TINKER_BASE_URL here).
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(UsageError, match=r"cannot reach http://127.0.0.1:9"):
        asyncio.run(TinkerBackend().setup(load_config(tinker_config(None))))


def test_a_local_vllm_setting_the_model_cannot_take_stops_the_run_at_start_up(
    tinker_config: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Checked before vLLM is imported: holds without the vllm package too."""
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    config = tinker_config()
    config["tinker"] |= {"local_engine": "vllm", "local_vllm": {"max_model_len": 100000}}
    with pytest.raises(UsageError, match="the local Tinker server failed to start"):
        asyncio.run(TinkerBackend().setup(load_config(config)))
    err = capfd.readouterr().err.strip()  # the server's own line (a child process)
    assert len(err.splitlines()) == 1, err
    assert "'--vllm.max_model_len': 100000 exceeds the model's 256 positions" in err, err


def test_the_folded_entropy_bonus_keeps_the_policy_more_random(
    server: LocalServer, tinker_config: Any
) -> None:
    # The digits reward makes the policy more certain; the bonus (folded into advantages, as
    # Tinker's losses have no entropy term) holds it back. Same seeds, so only the bonus differs.
    entropy = {}
    for coef in (0.0, 0.5):
        trainer = {"total_steps": 4, "batch_size": 8, "filter_groups": False, "entropy_coef": coef}
        config = tinker_config(server.base_url, name=f"entropy-{coef}", trainer=trainer)
        run_dir = UnifiedTrainer(config, train_tasks=digits_tasks()).fit().run_dir
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        entropy[coef] = [r["train/entropy"] for r in rows if "train/entropy" in r]
    # Step 1 samples the same policy (batching moves logprobs by float rounding only).
    assert len(entropy[0.0]) == 4 and entropy[0.0][0] == pytest.approx(entropy[0.5][0], abs=0.05)
    assert entropy[0.5][-1] > entropy[0.0][-1] + 0.05, f"the bonus did not raise entropy: {entropy}"


def test_the_adaptive_entropy_coefficient_is_the_one_folded_into_the_advantages(
    server: LocalServer, tinker_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folded: list[float | None] = []

    def recording(*args: Any, **kw: Any) -> Any:
        folded.append(kw.get("entropy_fold"))
        return sequences_of(*args, **kw)

    monkeypatch.setattr("backends.tinker.backend.sequences_of", recording)
    trainer = {
        "total_steps": 3,
        "filter_groups": False,
        "entropy_coef": 0.0,
        "entropy_target": 10.0,  # above any entropy: the coefficient only rises
        "entropy_coef_step": 0.25,
    }
    config = tinker_config(server.base_url, name="adaptive-entropy", trainer=trainer)
    run_dir = UnifiedTrainer(config, train_tasks=digits_tasks()).fit().run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    logged = [r["train/entropy_coef"] for r in rows if "train/entropy_coef" in r]
    assert logged == pytest.approx([0.0, 0.25, 0.5])
    assert folded == pytest.approx(logged), "each step folds the coefficient it logs"


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (Linux `/proc`)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def running(pid: int) -> bool:
    """Whether `pid` is alive: not gone, and not a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_run_resumes_at_its_last_checkpoint_and_leaves_no_server_behind(
    tmp_path: Path, tinker_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    data = {"train": {"generator": "unified.testing:digits_tasks", "n": 64}}
    trainer = {"total_steps": 1000, "save_every": 2}
    config = tinker_config(name="killed", data=data, trainer=trainer)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    run_dir = Path(config["logging"]["run_dir"]) / "killed"
    command = "import sys; from unified.cli import main; sys.exit(main())"
    process = subprocess.Popen([sys.executable, "-c", command, "train", str(path)])
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "step_000002" / "trainer_state.json").is_file():
            assert process.poll() is None, (
                f"the run ended ({process.returncode}) before a checkpoint"
            )
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        children = child_pids(process.pid)
        assert children, "the trainer runs its local server as a child process"
    finally:
        process.kill()
        process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(pid) for pid in children), "the killed trainer left its server running"

    resumed = {**config, "resume": True, "trainer": {**config["trainer"]}}
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    last = int(checkpoints[-1].name.removeprefix("step_"))
    resumed["trainer"]["total_steps"] = last + 2
    result = UnifiedTrainer(resumed).fit()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert result.steps == last + 2, f"resumed at {last}, ended at {result.steps}"
    assert steps == list(range(1, last + 3)), f"step count not continuous: {steps}"


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "stop": [], "seed": 1}


@pytest.fixture
async def kl_backend(server: LocalServer, tinker_config: Any) -> AsyncIterator[TinkerBackend]:
    """A backend set up on the test server with a KL penalty (so with a reference client)."""
    backend = TinkerBackend()
    await backend.setup(load_config(tinker_config(server.base_url, trainer={"kl_coef": 0.1})))
    try:
        yield backend
    finally:
        await backend.shutdown()


async def test_a_request_running_at_a_weight_sync_finishes_on_the_old_version(
    kl_backend: TinkerBackend,
) -> None:
    engine = SamplingEngine(kl_backend.token_sampler())
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        # The task reads the sampling client when it starts, before the sync publishes one.
        running = tg.create_task(engine.complete([5, 6, 7], **SAMPLING))
        await kl_backend.on_policy_updated(1)
        after = await engine.complete([5, 6, 7], **SAMPLING)
    before = running.result()
    assert before.policy_version == 0, "a request started before the sync keeps its version"
    assert after.policy_version == 1, "a request started after the sync samples version 1"


async def test_the_kl_reference_stays_the_base_model_while_the_policy_trains(
    kl_backend: TinkerBackend,
) -> None:
    engine = SamplingEngine(kl_backend.token_sampler())
    async with asyncio.timeout(120):
        # Version 0 samples the base model: its logprobs are the reference's own.
        outputs = [await engine.complete([5, 6, 7 + i], **SAMPLING) for i in range(4)]
        groups = [base_sample_group(outputs)]
        before = await kl_backend.forward_backward(groups)
        await kl_backend.optim_step()
        after = await kl_backend.forward_backward(groups)
        await kl_backend.optim_step()
    assert abs(before["train/kl_reference"]) < 1e-4, f"base vs base: {before}"
    assert abs(after["train/kl_reference"]) < 1e-4, f"a trained step moved the reference: {after}"


def base_sample_group(outputs: list[ModelOutput]) -> TrajectoryGroup:
    """One group of the given outputs with advantages +1 / -1, so a step changes the policy."""
    episodes = [
        Episode(
            task_id="t",
            rollout_index=i,
            trajectories=[Trajectory(steps=[Step(messages=[], output=out)], reward=float(i % 2))],
        )
        for i, out in enumerate(outputs)
    ]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(outputs))]
    return TrajectoryGroup(task_id="t", episodes=episodes, advantages=advantages, policy_version=0)


async def test_the_adapters_layer_switches_reach_the_server(
    server: LocalServer, tinker_config: Any
) -> None:
    config = tinker_config(server.base_url)
    config["tinker"] |= {"train_attn": False, "train_unembed": False}
    backend = TinkerBackend()
    await backend.setup(load_config(config))
    try:
        shapes = [m.training.lora for m in server.service.models.values()]
        assert shapes, "the backend created its training client"
        for lora in shapes:
            assert (lora.train_attn, lora.train_mlp, lora.train_unembed) == (False, True, False)
    finally:
        await backend.shutdown()


def test_adapters_on_no_layer_are_a_config_error(tinker_config: Any) -> None:
    config = tinker_config()
    config["tinker"] |= {"train_attn": False, "train_mlp": False, "train_unembed": False}
    with pytest.raises(ConfigError, match=r"all false: nothing would train") as caught:
        TinkerBackend().check_config(load_config(config))
    assert "\n" not in str(caught.value)
