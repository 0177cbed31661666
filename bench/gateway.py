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

- floor: both clients against a route on the same server answering a canned reply (one the
  gateway gave): what HTTP on loopback and the client cost against any endpoint, with no work.

The gateway's overhead is its path from the bare client over `engine.chat`: HTTP on loopback
plus its own work, the difference of the medians of `--rounds` rounds (target <= 2 ms). The
`openai` client's own work is printed beside it: an agent pays it against any OpenAI endpoint.

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
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

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
        return await openai_calls(gateway.base_url(session), calls, session.api_key)


async def raw_http(gateway: Gateway, calls: int, base_url: str | None = None) -> float:
    """Seconds per call through the gateway from a bare `httpx` client: the gateway and HTTP,
    without the `openai` client's own request building and response parsing (`base_url`:
    another endpoint on the same server instead)."""
    async with (
        gateway.session(SamplingEngine(InstantSampler())) as session,
        httpx.AsyncClient() as http,
    ):
        url = f"{base_url or gateway.base_url(session)}/chat/completions"
        headers = {"Authorization": f"Bearer {session.api_key}"}
        body = {"model": "policy", "messages": messages()}
        await http.post(url, headers=headers, json=body)  # connect
        started = time.perf_counter()
        for _ in range(calls):
            (await http.post(url, headers=headers, json=body)).raise_for_status()
        return (time.perf_counter() - started) / calls


async def canned_endpoint(gateway: Gateway) -> str:
    """Add a route to the gateway's server that answers every chat call with one reply the
    gateway gave, doing no work; return its base URL."""
    async with gateway.session(SamplingEngine(InstantSampler())) as session:
        reply = await openai.AsyncOpenAI(
            base_url=gateway.base_url(session), api_key=session.api_key
        ).chat.completions.create(model="policy", messages=messages())
    body = reply.model_dump(exclude_none=True)

    async def answer(request: Request) -> JSONResponse:
        await request.json()
        return JSONResponse(body)

    gateway.app.router.routes.append(Route("/canned/v1/chat/completions", answer, methods=["POST"]))
    return f"http://{gateway.host}:{gateway.port}/canned/v1"


async def openai_calls(base_url: str, calls: int, api_key: str = "-") -> float:
    """Seconds per call from the `openai` client to `base_url`, one after another."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    await client.chat.completions.create(model="policy", messages=messages())  # connect
    started = time.perf_counter()
    for _ in range(calls):
        await client.chat.completions.create(model="policy", messages=messages())
    elapsed = time.perf_counter() - started
    await client.close()
    return elapsed / calls


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
    rounds: dict[str, list[float]] = {k: [] for k in ("direct", "openai", "bare", "fo", "fb")}
    async with Gateway.running() as gateway:
        canned = await canned_endpoint(gateway)
        for _ in range(args.rounds):
            rounds["direct"].append(await direct(args.calls))
            rounds["openai"].append(await through_gateway(gateway, args.calls))
            rounds["bare"].append(await raw_http(gateway, args.calls))
            rounds["fo"].append(await openai_calls(canned, args.calls))
            rounds["fb"].append(await raw_http(gateway, args.calls, base_url=canned))
        many = await concurrent(gateway, args.sessions, args.turns)
        own = await concurrent(gateway, args.sessions, args.turns, own_client=True)
    ms = {k: statistics.median(v) * 1e3 for k, v in rounds.items()}
    overhead_ms = ms["bare"] - ms["direct"]
    client_ms = ms["openai"] - ms["bare"]
    verdict = "met" if overhead_ms <= 2.0 else "NOT met"
    print(f"direct engine.chat        {ms['direct']:8.3f} ms per call (median of {args.rounds})")
    print(f"through the gateway       {ms['bare']:8.3f} ms per call (a bare httpx client)")
    print(f"gateway overhead          {overhead_ms:8.3f} ms per call (target <= 2 ms: {verdict})")
    print(
        f"  of which HTTP on loopback {ms['fb']:.3f} ms (the same client and server, a canned "
        f"reply), the gateway's own work {overhead_ms - ms['fb']:.3f} ms"
    )
    print(
        f"the openai client adds    {client_ms:8.3f} ms per call ({ms['openai']:.3f} ms in all; "
        f"against the canned reply it adds {ms['fo'] - ms['fb']:.3f} ms: its own work, paid "
        "against any endpoint)"
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
        "direct_ms": ms["direct"],
        "gateway_ms": ms["bare"],
        "overhead_ms": overhead_ms,
        "http_floor_ms": ms["fb"],
        "openai_client_ms": client_ms,
        "openai_path_ms": ms["openai"],
        "openai_canned_ms": ms["fo"],
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
