"""The OpenAI-compatible gateway, driven by the real `openai` client (and raw httpx for what a
client library would not send): chat, streaming, tools, token-for-token prompts, sessions, errors,
deadlines, the loopback address, and training through `AgentWorkflow` on the local backend."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from gateway.server import Gateway
from gateway.session import AgentSession
from torchkit.builtin import build_tokenizer, load_policy
from torchkit.sampler import BatchingSampler
from unified import UnifiedTrainer
from unified.rollout import SamplingEngine, WorkflowDeadlines, resolve_workflow, run_episode
from unified.types import ModelOutput, SamplingParams, Task, Trajectory
from workflows.agent import AgentWorkflow

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
EXAMPLES = Path(__file__).parent.parent / "examples" / "countdown"
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "3*7+12"}}</tool_call>'


class ScriptedSampler:
    """A `TokenSampler` replying with the next scripted text (built-in tokenizer, end token)."""

    def __init__(self, replies: list[str]) -> None:
        self.tokenizer = build_tokenizer()
        self.replies = list(replies)
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        self.requests.append((list(prompt_ids), params))
        text = self.replies.pop(0)
        ids = [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]
        return ModelOutput(
            text=text,
            prompt_ids=list(prompt_ids),
            completion_ids=ids,
            logprobs=[-0.5] * len(ids),
            finish_reason="stop",
            policy_version=0,
        )


@pytest.fixture(scope="module")
def tiny() -> BatchingSampler:
    model, tokenizer = load_policy("builtin:tiny", seed=0)
    return BatchingSampler(model, tokenizer)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with Gateway.running() as running:
        yield running


def client(gateway: Gateway, session: AgentSession) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.api_key)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_a_chat_completion_is_the_policys_sample_with_its_tokens_recorded(
    gateway: Gateway, tiny: BatchingSampler
) -> None:
    engine = SamplingEngine(tiny, SamplingParams(max_tokens=12), seed=3)
    async with gateway.session(engine) as session:
        reply = await client(gateway, session).chat.completions.create(
            model="policy", messages=user("3 7 12 -> 33"), max_tokens=6
        )
    (step,) = session.steps
    out = step.output
    assert reply.choices[0].message.content == out.text
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(out.completion_ids) <= 6
    assert reply.usage.prompt_tokens == len(out.prompt_ids)
    assert out.prompt_ids == engine.encode_chat(user("3 7 12 -> 33")), "templated once, here"
    assert len(out.logprobs) == len(out.completion_ids) and out.policy_version == 0
    assert engine.completion_tokens == len(out.completion_ids), "tokens counted once"
    assert step.messages == user("3 7 12 -> 33")


async def test_streaming_answers_the_same_completion_as_server_sent_events(
    gateway: Gateway,
) -> None:
    engine = SamplingEngine(ScriptedSampler(["hello there"]))
    async with gateway.session(engine) as session:
        stream = await client(gateway, session).chat.completions.create(
            model="policy",
            messages=user("hi"),
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == "hello there" and finish[-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_tool_calls_come_back_as_openai_tool_calls_and_results_extend_the_prompt(
    gateway: Gateway,
) -> None:
    sampler = ScriptedSampler([CALL, "3*7+12"])
    engine = SamplingEngine(sampler)
    async with gateway.session(engine) as session:
        api = client(gateway, session)
        messages: list[Any] = user("3 7 12 -> 33")
        first = await api.chat.completions.create(model="p", messages=messages, tools=[CALC])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "calc"
        assert json.loads(call.function.arguments) == {"expr": "3*7+12"}
        messages += [
            choice.message.model_dump(exclude_none=True),  # as agents append it
            {"role": "tool", "tool_call_id": call.id, "content": "33"},
        ]
        second = await api.chat.completions.create(model="p", messages=messages, tools=[CALC])
    assert second.choices[0].message.content == "3*7+12"
    first_step, second_step = session.steps
    a, b = first_step.output, second_step.output
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == [
        *a.prompt_ids,
        *a.completion_ids,
    ], "the second prompt extends the first prompt and completion token for token"
    assert second_step.info["extends_previous"] and second_step.info["spliced"]
    assert first_step.info["tool_calls"] == 1 and first_step.info["tool_errors"] == 0
    trajectory = Trajectory(steps=session.steps, reward=1.0)
    assert len(trajectory.sequences()) == 1, "trained as one sequence, tool result masked"
    tail = b.prompt_ids[len(a.prompt_ids) + len(a.completion_ids) :]
    assert "33" in engine.tokenizer.decode(tail), "the tool result is prompt, not completion"


async def test_a_rewritten_history_starts_a_new_sequence_and_says_so(gateway: Gateway) -> None:
    engine = SamplingEngine(ScriptedSampler(["first", "second"]))
    async with gateway.session(engine) as session:
        api = client(gateway, session)
        await api.chat.completions.create(model="p", messages=user("a"))
        edited = [*user("a"), {"role": "assistant", "content": "not what you said"}, *user("b")]
        await api.chat.completions.create(model="p", messages=edited)
    assert session.steps[1].info == {
        "extends_previous": False,
        "spliced": False,
        "tool_calls": 0,
        "tool_errors": 0,
    }
    assert len(Trajectory(steps=session.steps, reward=0.0).sequences()) == 2


async def test_a_malformed_tool_call_comes_back_as_content_and_is_counted(
    gateway: Gateway,
) -> None:
    garbled = '<tool_call>{"name": "calc", "arguments": </tool_call>'
    engine = SamplingEngine(ScriptedSampler([garbled]))
    async with gateway.session(engine) as session:
        reply = await client(gateway, session).chat.completions.create(
            model="p", messages=user("x"), tools=[CALC]
        )
    message = reply.choices[0].message
    assert message.content == garbled and not message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    assert session.steps[0].info["tool_errors"] == 1


async def test_the_trainers_sampling_settings_win_and_max_tokens_and_stop_are_the_clients(
    gateway: Gateway,
) -> None:
    sampler = ScriptedSampler(["one", "two"])
    defaults = SamplingParams(temperature=1.0, max_tokens=40, stop=["\n"])
    engine = SamplingEngine(sampler, defaults, seed=7)
    async with gateway.session(engine) as session:
        api = client(gateway, session)
        await api.chat.completions.create(
            model="p", messages=user("a"), temperature=0.2, seed=1, max_tokens=500, stop="END"
        )
        await api.chat.completions.create(model="p", messages=user("b"), max_completion_tokens=5)
    (_, first), (_, second) = sampler.requests
    assert first.temperature == 1.0 and first.seed == 7_000, "the trainer's temperature, seed"
    assert first.max_tokens == 40 and first.stop == ["\n", "END"]
    assert second.max_tokens == 5 and second.seed == 7_001
    assert session.overridden == 1


async def test_a_prompt_past_the_models_positions_is_a_400_naming_the_limit(
    gateway: Gateway, tiny: BatchingSampler
) -> None:
    engine = SamplingEngine(tiny, SamplingParams(max_tokens=8))
    async with gateway.session(engine) as session:
        with pytest.raises(openai.BadRequestError, match="exceeds the model's 256 positions"):
            await client(gateway, session).chat.completions.create(
                model="p", messages=user("9" * 300)
            )
    assert not session.steps


async def test_concurrent_sessions_keep_their_own_calls(
    gateway: Gateway, tiny: BatchingSampler
) -> None:
    async def agent(index: int) -> tuple[AgentSession, list[str]]:
        engine = SamplingEngine(tiny, SamplingParams(max_tokens=4), seed=index)
        async with gateway.session(engine) as session:
            api = client(gateway, session)
            asked = [f"{index} {turn}" for turn in range(3)]
            for prompt in asked:
                await api.chat.completions.create(model="p", messages=user(prompt))
        return session, asked

    async with asyncio.TaskGroup() as tg:
        runs = [tg.create_task(agent(i)) for i in range(8)]
    for run in runs:
        session, asked = run.result()
        assert [s.messages[0]["content"] for s in session.steps] == asked
    assert not gateway.sessions, "every session closed with its rollout"


async def test_bad_requests_get_openai_error_json_and_a_4xx(gateway: Gateway) -> None:
    engine = SamplingEngine(ScriptedSampler(["x"] * 4))
    async with gateway.session(engine) as session, httpx.AsyncClient() as http:
        base = gateway.base_url(session)
        auth = {"Authorization": f"Bearer {session.api_key}"}
        cases = [
            ("POST", f"{base}/chat/completions", auth, b"{not json", 400),
            ("POST", f"{base}/chat/completions", auth, b'{"messages": []}', 400),
            ("POST", f"{base}/chat/completions", auth, b'{"messages": "hi"}', 400),
            ("POST", f"{base}/chat/completions", {}, b'{"messages": []}', 401),
            ("POST", base.replace(session.id, "nope") + "/chat/completions", auth, b"{}", 404),
            ("GET", f"{base}/chat/completions", auth, b"", 405),
            ("POST", f"{base}/completions", auth, b'{"prompt": "a", "echo": true}', 400),
        ]
        for method, url, headers, body, status in cases:
            answer = await http.request(method, url, headers=headers, content=body)
            assert answer.status_code == status, (url, body, answer.text)
            error = answer.json()["error"]
            assert error["message"] and error["type"], answer.text
        api = client(gateway, session)
        for bad in ({"n": 2}, {"logprobs": True}, {"tool_choice": "required", "tools": [CALC]}):
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(model="p", messages=user("a"), **bad)
            assert next(iter(bad)) in str(refused.value)
    assert not session.steps, "no refused request was sampled"


async def test_an_agent_that_never_returns_hits_the_workflow_deadline_and_its_session_closes(
    gateway: Gateway,
) -> None:
    started = asyncio.Event()

    class Stuck:
        """Never answers: a long model call, then waits forever."""

        async def __call__(self, task: Task, base_url: str, api_key: str) -> float:
            api = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
            await api.chat.completions.create(model="p", messages=user("hi"))
            started.set()
            await asyncio.Event().wait()
            return 1.0

    async def stuck(task: Task, base_url: str, api_key: str) -> float:
        return await Stuck()(task, base_url, api_key)

    workflow = resolve_workflow(AgentWorkflow(stuck))
    engine = SamplingEngine(ScriptedSampler(["x"]))
    episode, error = await run_episode(
        workflow,
        Task(id="t"),
        engine,
        rollout_index=0,
        version=0,
        deadlines=WorkflowDeadlines(0.5),
    )
    assert started.is_set() and episode.status == "timeout" and isinstance(error, TimeoutError)
    assert not gateway.sessions, "the timed-out rollout's session is closed"


async def test_a_call_in_flight_when_its_session_closes_is_answered_404() -> None:
    release = asyncio.Event()

    class Slow(ScriptedSampler):
        async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
            await release.wait()
            return await super().sample(prompt_ids, params)

    async with Gateway.running() as gateway:
        engine = SamplingEngine(Slow(["late"]))
        async with gateway.session(engine) as session:
            api = openai.AsyncOpenAI(
                base_url=gateway.base_url(session), api_key=session.api_key, max_retries=0
            )
            call = asyncio.ensure_future(api.chat.completions.create(model="p", messages=user("a")))
            await asyncio.sleep(0.2)
        with pytest.raises(openai.NotFoundError, match="closed"):
            await asyncio.wait_for(call, 10)
        assert not session.steps


async def test_the_gateway_listens_on_loopback_only(gateway: Gateway) -> None:
    assert gateway.host == "127.0.0.1"
    others = {
        info[4][0]
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        if not info[4][0].startswith("127.")
    }
    for address in others:  # the machine's other interfaces: nothing listens there
        with pytest.raises(OSError), socket.create_connection((address, gateway.port), 2):
            pass
    with socket.create_connection(("127.0.0.1", gateway.port), 2):
        pass


async def calc_agent(task: Task, base_url: str, api_key: str) -> dict[str, Any]:
    """An agent with no `unified` import: ask, run the tool it calls, answer; reward length."""
    api = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages: list[Any] = user(str(task.data["prompt"]))
    reply = await api.chat.completions.create(
        model="policy", messages=messages, tools=[CALC], max_tokens=6
    )
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "33"})
    final = await api.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    text = final.choices[0].message.content or ""
    return {"reward": float(text.count("3")), "correct": "33" in text, "length": len(text)}


def agent_config(tmp_path: Path, name: str, **sections: Any) -> dict[str, Any]:
    """A two-step run of `calc_agent` through `AgentWorkflow` on the built-in tiny model; keyword
    sections are merged over these (`trainer` key by key)."""
    trainer = {
        "total_steps": 2,
        "batch_size": 2,
        "group_size": 2,
        "lr": 1e-3,
        "eval_every": 0,
        "eval_before_train": False,
        "save_every": 0,
        **sections.pop("trainer", {}),
    }
    return {
        "name": name,
        "backend": "local",
        "model": "builtin:tiny",
        "workflow": "workflows.agent:AgentWorkflow",
        "workflow_args": {"agent": "tests.test_gateway:calc_agent"},
        "trainer": trainer,
        "sampling": {"train": {"max_tokens": 8}},
        "logging": {"run_dir": str(tmp_path), "console": False},
        **sections,
    }


def agent_tasks() -> list[Task]:
    return [Task(id=str(i), data={"prompt": f"{i} 3 -> 33"}) for i in range(8)]


def test_an_openai_agent_trains_through_agent_workflow_on_the_local_backend(
    tmp_path: Path,
) -> None:
    config = agent_config(
        tmp_path,
        "agent",
        mode="async",
        trainer={"eval_every": 2, "eval_before_train": True, "workflow_timeout_s": 30},
        sampling={"train": {"max_tokens": 8}, "eval": {"max_tokens": 8}},
    )
    tasks = agent_tasks()
    torch.manual_seed(0)
    result = UnifiedTrainer(config, train_tasks=tasks, eval_tasks=tasks[:2]).fit()
    metrics = result.metrics
    assert result.steps == 2 and metrics["episodes/errors"] == 0
    assert metrics["groups/trained"] == 2 and metrics["policy/version"] == 2
    assert metrics["train/grad_norm"] > 0
    assert metrics["train/kl_sample_train"] == pytest.approx(0.0, abs=1e-5), (
        "the gateway's logprobs are the trainer's: the recorded tokens are the sampled ones"
    )
    assert "rollout/tool_use" in metrics and "eval/tool_use" in metrics, "tool calls counted"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("", None),
        ("workflow_args.agent=examples.countdown.openai_agent:nope", "has no attribute 'nope'"),
        ("workflow_args.agnt=x", "unexpected keyword argument 'agnt'"),
        ("workflow_args.agent=examples.countdown.openai_agent:CALC", "not an async function"),
    ],
)
def test_the_openai_agent_example_config_checks_its_agent_at_start_up(
    capsys: pytest.CaptureFixture[str], override: str, expected: str | None
) -> None:
    from unified.cli import main

    config = EXAMPLES / "local_openai_agent_sync.yaml"
    code = main(["train", str(config), "--dry-run", *([override] if override else [])])
    err = capsys.readouterr().err
    if expected is None:
        assert code == 0, err
    else:
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "config",
    [
        "local_openai_agent_sync",
        "local_agents_sdk_sync",
        "tinker_openai_agent_sync",
        "tinker_agents_sdk_sync",
    ],
)
def test_each_agent_example_has_a_config_and_script_on_the_local_and_tinker_backends(
    capsys: pytest.CaptureFixture[str], config: str
) -> None:
    from unified.cli import main

    code = main(["train", str(EXAMPLES / f"{config}.yaml"), "--dry-run"])
    assert code == 0, capsys.readouterr().err
    script = (EXAMPLES / f"{config}.sh").read_text()
    assert f"examples/countdown/{config}.yaml" in script


async def test_an_openai_agents_sdk_agent_runs_through_the_gateway_token_for_token(
    gateway: Gateway,
) -> None:
    from examples.countdown import agents_sdk_agent

    miss = '<tool_call>{"name": "calc", "arguments": {"expr": "3*7+1"}}</tool_call>'
    engine = SamplingEngine(ScriptedSampler([miss, "3*7+12"]))
    task = Task(id="t", data={"numbers": [3, 7, 12], "target": 33})
    async with gateway.session(engine, declare_tools=False) as session:
        result = await agents_sdk_agent.solve(task, gateway.base_url(session), session.api_key)
    assert result == {"reward": 1.0, "correct": True, "checks": 2}
    first, second = session.steps
    assert first.info["tool_calls"] == 1 and second.messages[-1]["role"] == "tool"
    assert second.messages[-1]["content"] == "22", "the SDK ran calc on the parsed arguments"
    assert second.info["spliced"] and second.info["extends_previous"]
    assert len(Trajectory(steps=session.steps, reward=1.0).sequences()) == 1


def test_an_openai_agent_trains_through_agent_workflow_on_the_tinker_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No URL and no key: the tinker backend starts its own local Tinker-compatible server."""
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    config = agent_config(
        tmp_path,
        "agent-tinker",
        backend="tinker",
        trainer={"workflow_timeout_s": 120, "stall_timeout_s": 300},
        tinker={"lora_rank": 8, "request_timeout_s": 300},
    )
    tasks = agent_tasks()
    result = UnifiedTrainer(config, train_tasks=tasks).fit()
    metrics = result.metrics
    assert result.steps == 2 and metrics["episodes/errors"] == 0
    assert metrics["groups/trained"] == 2 and "rollout/tool_use" in metrics


def test_an_openai_agent_trains_on_a_ray_rollout_worker(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """On a worker the agent's gateway runs in the worker's process, one per episode."""
    import ray

    from unified.ray_runtime import start_local_ray

    start_local_ray(num_cpus=2)
    started = capfd.readouterr()
    assert "Ray" not in started.out + started.err, "Ray's start-up notices stay off the console"
    try:
        config = agent_config(
            tmp_path,
            "agent-ray",
            rollout={"workers": 1, "worker_cpus": 0.5},
            trainer={"total_steps": 1, "workflow_timeout_s": 60},
        )
        tasks = agent_tasks()
        result = UnifiedTrainer(config, train_tasks=tasks).fit()
    finally:
        ray.shutdown()
    assert result.steps == 1 and result.metrics["episodes/errors"] == 0
    assert result.metrics["groups/trained"] == 2
