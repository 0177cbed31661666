"""Seconds per weight sync into vLLM on a GPU, each way: shared memory, CUDA IPC, NCCL.

For each mode in turn, one engine (`VllmSampler.start` with `weight_transfer: MODE`) and the
trainer's state dict on the trainer's GPU (cuda:0): `--rounds` + 1 syncs through
`VllmSampler.load_weights` (pause, transfer, resume; the first sets the transfer up and is
reported apart), then one request sampled on the new weights. nccl needs two GPUs (the engine on
the second) and is skipped with fewer. Needs the CUDA vllm wheel; run by
`bench/gpu/vllm_transfer_check.sh` (docs/engines.md, GPU weight transfer).

    python -m bench.vllm_transfer --model DIR --rounds 3 --json runs/vllm-transfer.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from torchkit.builtin import load_policy, save_policy
from torchkit.vllm_engine import VllmSampler
from unified.types import SamplingParams

MODES = ("shared_memory", "ipc", "nccl")


async def measure(sampler: VllmSampler, state: dict[str, torch.Tensor], rounds: int) -> list[float]:
    """Seconds of each of `rounds` + 1 syncs of `state`, then one request on the new weights."""
    times = []
    for version in range(1, rounds + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        await sampler.load_weights(state, version)
        times.append(time.perf_counter() - start)
    out = await sampler.sample([1, 2, 3], SamplingParams(max_tokens=4, seed=0))
    assert out.policy_version == rounds + 1, out.policy_version
    return times


def run_mode(mode: str, directory: Path, state: dict[str, torch.Tensor], args: Any) -> list[float]:
    settings = {"weight_transfer": mode, "dtype": args.dtype, "kv_cache_gb": args.kv_cache_gb}
    sampler = VllmSampler.start(directory, settings)
    try:
        return asyncio.run(measure(sampler, state, args.rounds))
    finally:
        sampler.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny", help="built-in name or directory")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model, tokenizer = load_policy(args.model)
    state = {name: t.detach().to("cuda:0") for name, t in model.state_dict().items()}
    params = sum(t.numel() for t in state.values())
    results: dict[str, Any] = {"model": args.model, "parameters": params, "dtype": args.dtype}
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as root:
        directory = Path(root) / "policy"
        save_policy(model, tokenizer, directory)
        for mode in args.modes:
            if mode == "nccl" and torch.cuda.device_count() < 2:
                print("nccl: skipped (needs two GPUs)", flush=True)
                continue
            times = run_mode(mode, directory, state, args)
            results[mode] = {"first_s": times[0], "median_s": statistics.median(times[1:])}
            print(
                f"{mode}: {params / 1e6:.1f}M parameters ({args.dtype} engine): first sync "
                f"{times[0]:.3f} s, then median {results[mode]['median_s']:.3f} s "
                f"(rounds {', '.join(f'{t:.3f}' for t in times[1:])})",
                flush=True,
            )
    results["device"] = torch.cuda.get_device_name(0)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
