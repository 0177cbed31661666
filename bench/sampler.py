"""Sampler speed: the local sampler against Hugging Face `model.generate()`, same model and batch.

Both sample the same prompts (countdown prompts under the chat template) from the same built-in
model with the same settings (temperature 1, top-p 1, the same max new tokens, stop at the
end-of-turn token). Rounds alternate between the two in one process; the figure is the ratio of
median generated tokens per second. A second figure shows request batching: N concurrent
`chat` calls through the backend's engine against the same N calls made one at a time. A third
times the prefill of a batch mixing first turns with later turns of tool conversations (as an
agent's batches do), in groups of similar length against one group padded to the longest.

    python -m bench.sampler --json runs/bench-sampler.json
    python -m bench.sampler --model <hf-dir> --device cuda --dtype bf16   (a GPU: see bench/gpu/)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from backends.local.backend import LocalBackend
from examples.countdown.tasks import make_tasks, prompt
from torchkit import decoding
from torchkit.builtin import load_policy
from torchkit.sampler import Request, generate_batch
from unified.chat import chat_prompt_ids
from unified.config import load_config
from unified.rollout import SamplingEngine
from unified.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--bandwidth-gbs", type=float, help="memory bandwidth, GB/s: also print the decode bound"
    )
    parser.add_argument(
        "--no-batching", action="store_true", help="skip the concurrent-vs-one-at-a-time figure"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible; use --device cpu")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, tokenizer = load_policy(args.model, dtype=dtype)
    model.to(args.device).eval()
    messages = [[{"role": "user", "content": prompt(t.data)}] for t in make_tasks(args.batch)]
    prompts = [chat_prompt_ids(tokenizer, m) for m in messages]
    eos = tokenizer.eos_token_id

    def ours() -> int:
        params = [
            SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i)
            for i in range(args.batch)
        ]
        outputs = generate_batch(
            model,
            tokenizer,
            [Request(p, s) for p, s in zip(prompts, params, strict=True)],
            version=0,
        )
        return sum(len(o.completion_ids) for o in outputs)

    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (
        torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]
    ).long()
    ids, mask = ids.to(args.device), mask.to(args.device)

    def timed(fn: Any) -> tuple[int, float]:
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - started

    def hf() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.max_tokens,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[:, width:]
        # Tokens up to and including the first end-of-turn, like the local sampler reports.
        ended = (new == eos).int().cumsum(-1)
        return int(((ended == 0) | ((ended == 1) & (new == eos))).sum())

    rates: dict[str, list[float]] = {"local": [], "hf_generate": []}
    for round_ in range(args.rounds + 1):  # the first round warms up (kernels, allocator)
        for name, fn in (("local", ours), ("hf_generate", hf)):
            tokens, seconds = timed(fn)
            if round_:
                rates[name].append(tokens / seconds)
    local, hf_rate = statistics.median(rates["local"]), statistics.median(rates["hf_generate"])
    batching = None if args.no_batching else asyncio.run(_batching(args, messages))
    prefill = _mixed_prefill(model, tokenizer, messages, args.rounds)
    # Each decode step reads every weight once: the batch's tokens/s cannot pass this.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = args.bandwidth_gbs * 1e9 / weight_bytes * args.batch if args.bandwidth_gbs else None
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "tokens_per_s": {"local": local, "hf_generate": hf_rate},
        "speedup_vs_generate": local / hf_rate,
        "weight_bytes": weight_bytes,
        "bandwidth_bound_tokens_per_s": bound,
        "batching": batching,
        "mixed_prefill": prefill,
    }
    print(f"local sampler   {local:8.0f} tokens/s (median of {args.rounds})")
    print(f"model.generate  {hf_rate:8.0f} tokens/s")
    print(f"speedup: {local / hf_rate:.2f}x")
    if bound is not None:
        print(
            f"bandwidth bound ({weight_bytes / 2**30:.2f} GiB of weights read per decode step, "
            f"{args.bandwidth_gbs:.0f} GB/s, batch {args.batch}): {bound:.0f} tokens/s; "
            f"local {local / bound:.1%}, model.generate {hf_rate / bound:.1%} of it"
        )
    if batching is not None:
        print(
            f"{args.batch} concurrent chat calls: {batching['concurrent_s']:.2f} s in "
            f"{batching['batches']} batch(es); one at a time: {batching['sequential_s']:.2f} s "
            f"({batching['sequential_s'] / batching['concurrent_s']:.1f}x)"
        )
    grouped, one = prefill["grouped_s"], prefill["one_group_s"]
    print(
        f"prefill of {args.batch} prompts of {prefill['min_len']:.0f}-{prefill['max_len']:.0f} "
        f"tokens: {grouped * 1e3:.0f} ms in {prefill['groups']:.0f} length groups, "
        f"{one * 1e3:.0f} ms as one group ({one / grouped:.2f}x)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


def _mixed_prefill(
    model: torch.nn.Module, tokenizer: Any, messages: list[list[dict[str, str]]], rounds: int
) -> dict[str, float]:
    """Median prefill time of a batch of first, second and third turns: grouped vs one group."""
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "3*7+12"}}</tool_call>'
    turns = [{"role": "assistant", "content": call}, {"role": "tool", "content": "33"}]
    prompts = [chat_prompt_ids(tokenizer, m + turns * (i % 3)) for i, m in enumerate(messages)]
    requests = [Request(p, SamplingParams(temperature=1.0, max_tokens=1, seed=0)) for p in prompts]
    lengths = [len(p) for p in prompts]
    own = decoding.group_overhead(next(model.parameters()).device)  # the sampler's on this device
    one_group = len(prompts) * max(lengths)  # more than any split saves
    times: dict[str, list[float]] = {"grouped": [], "one_group": []}
    for _ in range(rounds + 1):  # the first round warms up
        for name, overhead in (("grouped", own), ("one_group", one_group)):
            with mock.patch.object(decoding, "group_overhead", lambda _device, o=overhead: o):
                started = time.perf_counter()
                generate_batch(model, tokenizer, requests, version=0)  # type: ignore[arg-type]
                times[name].append(time.perf_counter() - started)
    return {
        "grouped_s": statistics.median(times["grouped"][1:]),
        "one_group_s": statistics.median(times["one_group"][1:]),
        "groups": float(len(decoding.prefill_groups(lengths, own))),
        "min_len": float(min(lengths)),
        "max_len": float(max(lengths)),
    }


async def _batching(
    args: argparse.Namespace, messages: list[list[dict[str, str]]]
) -> dict[str, float]:
    config = load_config(
        {"workflow": "unused:unused", "model": args.model, "local": {"device": args.device}}
    )
    backend = LocalBackend()
    await backend.setup(config)
    engine = SamplingEngine(backend.token_sampler())
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": args.max_tokens, "stop": []}
    started = time.perf_counter()
    await asyncio.gather(*[engine.chat(m, seed=i, **sampling) for i, m in enumerate(messages)])
    concurrent = time.perf_counter() - started
    batches = backend.sampler.batches
    started = time.perf_counter()
    for i, m in enumerate(messages):
        await engine.chat(m, seed=i, **sampling)
    sequential = time.perf_counter() - started
    await backend.shutdown()
    return {"concurrent_s": concurrent, "sequential_s": sequential, "batches": float(batches)}


if __name__ == "__main__":
    main()
