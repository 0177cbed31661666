"""Gateway overhead: an agent's call through the OpenAI endpoint against the engine called directly.

A zero-latency sampler (every request returns the same 16-token reply at once) under the real
`SamplingEngine`, so what is timed is the path, not a model:

- direct: `engine.chat(messages)` awaited `--calls` times, one after another;
- gateway: the same calls from the real `openai.AsyncOpenAI` client through `Gateway` (HTTP on
  127.0.0.1, request validation, the template, the session's recording, the JSON answer), and
  from a bare `httpx` client (what the gateway and HTTP cost without the `openai` client's own
  work, which the agent pays against any endpoint; client and server share one event loop);
- concurrent: `--sessions` sessions open at once, each making `--turns` chat calls that extend
  the conversation (tool results included), all on one gateway; each agent re-points one shared
  client (`with_options`), then, for comparison, builds its own `AsyncOpenAI` (which loads the
  CA bundle: the cost an agent written that way puts on the trainer's event loop).

The overhead per call is the difference of the medians of `--rounds` rounds (target <= 2 ms).

    python -m bench.gateway --json runs/bench-gateway.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from gateway.server import Gateway
from torchkit.builtin import build_tokenizer
from unified.rollout import SamplingEngine
from unified.types import ModelOutput, SamplingParams

REPLY = "3*7+12 is the one"  # 17 characters: 16 tokens and the end token


class InstantSampler:
    """A `TokenSampler` that answers every request at once with `REPLY`."""

    def __init__(self) -> None:
        self.tokenizer = build_tokenizer()
        self._reply = self.tokenizer.encode(REPLY)

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        ids = [*self._reply[:15], self.tokenizer.eos_token_id]
        return ModelOutput(
            text=REPLY,
            prompt_ids=prompt_ids,
            completion_ids=ids,
            logprobs=[-0.1] * len(ids),
            finish_reason="stop",
            policy_version=0,
        )


def messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "3 7 12 -> 33"}]


async def direct(calls: int) -> float:
    """Seconds per call of `engine.chat`, no gateway."""
    engine = SamplingEngine(InstantSampler())
    started = time.perf_counter()
    for _ in range(calls):
        await engine.chat(messages())
    return (time.perf_counter() - started) / calls


async def through_gateway(gateway: Gateway, calls: int) -> float:
    """Seconds per call from the `openai` client through the gateway."""
    async with gateway.session(SamplingEngine(InstantSampler())) as session:
        client = openai.AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.api_key)
        await client.chat.completions.create(model="policy", messages=messages())  # connect
        started = time.perf_counter()
        for _ in range(calls):
            await client.chat.completions.create(model="policy", messages=messages())
        elapsed = time.perf_counter() - started
        await client.close()
    return elapsed / calls


async def raw_http(gateway: Gateway, calls: int) -> float:
    """Seconds per call through the gateway from a bare `httpx` client: the gateway and HTTP,
    without the `openai` client's own request building and response parsing."""
    async with (
        gateway.session(SamplingEngine(InstantSampler())) as session,
        httpx.AsyncClient() as http,
    ):
        url = f"{gateway.base_url(session)}/chat/completions"
        headers = {"Authorization": f"Bearer {session.api_key}"}
        body = {"model": "policy", "messages": messages()}
        await http.post(url, headers=headers, json=body)  # connect
        started = time.perf_counter()
        for _ in range(calls):
            (await http.post(url, headers=headers, json=body)).raise_for_status()
        return (time.perf_counter() - started) / calls


async def concurrent(
    gateway: Gateway, sessions: int, turns: int, *, own_client: bool = False
) -> dict[str, float]:
    """`sessions` agents at once, each `turns` calls extending one conversation."""
    held = 0
    spliced = 0
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}", api_key="-")

    async def agent() -> None:
        nonlocal held, spliced
        async with gateway.session(SamplingEngine(InstantSampler())) as session:
            held = max(held, len(gateway.sessions))
            url, key = gateway.base_url(session), session.api_key
            api = (
                openai.AsyncOpenAI(base_url=url, api_key=key)
                if own_client
                else client.with_options(base_url=url, api_key=key)
            )
            history = messages()
            for _ in range(turns):
                reply = await api.chat.completions.create(model="policy", messages=history)
                history += [
                    reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "content": "33"},
                ]
            spliced += sum(bool(step.info["spliced"]) for step in session.steps)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(sessions):
            tg.create_task(agent())
    elapsed = time.perf_counter() - started
    await client.close()
    return {
        "sessions_held": float(held),
        "calls_per_s": sessions * turns / elapsed,
        "spliced_share": spliced / (sessions * (turns - 1)),
        "seconds": elapsed,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    plain, served, bare = [], [], []
    async with Gateway.running() as gateway:
        for _ in range(args.rounds):
            plain.append(await direct(args.calls))
            served.append(await through_gateway(gateway, args.calls))
            bare.append(await raw_http(gateway, args.calls))
        many = await concurrent(gateway, args.sessions, args.turns)
        own = await concurrent(gateway, args.sessions, args.turns, own_client=True)
    direct_s, gateway_s = statistics.median(plain), statistics.median(served)
    bare_s = statistics.median(bare)
    overhead_ms = (gateway_s - direct_s) * 1e3
    served_ms = (bare_s - direct_s) * 1e3
    print(f"direct engine.chat     {direct_s * 1e3:8.3f} ms per call (median of {args.rounds})")
    print(f"through the gateway    {gateway_s * 1e3:8.3f} ms per call (openai client, HTTP)")
    verdict = "met" if overhead_ms <= 2.0 else "NOT met"
    print(f"gateway overhead       {overhead_ms:8.3f} ms per call (target <= 2 ms: {verdict})")
    print(
        f"  of which the gateway and HTTP {served_ms:.3f} ms (a bare httpx client: "
        f"{bare_s * 1e3:.3f} ms per call), the openai client's own work "
        f"{(gateway_s - bare_s) * 1e3:.3f} ms"
    )
    print(
        f"{args.sessions} sessions x {args.turns} turns: {many['sessions_held']:.0f} held at "
        f"once, {many['calls_per_s']:.0f} calls/s, {many['spliced_share']:.0%} of follow-up "
        f"prompts spliced token for token, {many['seconds']:.2f} s"
    )
    print(
        f"... with a new AsyncOpenAI per agent instead: {own['calls_per_s']:.0f} calls/s "
        f"({many['calls_per_s'] / own['calls_per_s']:.1f}x slower), {own['seconds']:.2f} s"
    )
    return {
        "own_client_calls_per_s": own["calls_per_s"],
        "direct_ms": direct_s * 1e3,
        "gateway_ms": gateway_s * 1e3,
        "overhead_ms": overhead_ms,
        "gateway_and_http_ms": served_ms,
        **many,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    arguments = parser.parse_args()
    figures = asyncio.run(main(arguments))
    if arguments.json:
        arguments.json.parent.mkdir(parents=True, exist_ok=True)
        arguments.json.write_text(json.dumps(figures, indent=2))
