"""verl on a GPU: step time, weight-sync time and peak memory of `VerlBackend` on a ~0.5B Qwen2.

The backend is the project's own `VerlBackend`: verl's FSDP2 `TrainingWorker` on a Ray group of
`--workers` processes, the local sampler in this process on the same device. With
`--backend local` the same steps run on `LocalBackend` (fp32 AdamW and the sampler in this
process, no weight transfer), the figure verl's is read against. Each step does what
the sync loop does: sample `--batch-size` countdown groups of `--group-size` rollouts, then
`forward_backward` + `optim_step` (with `--kl-coef > 0`, the frozen reference scores the batch
first, as in the countdown recipe), then `on_policy_updated` (the loop's `time/sync`). The first
`--warmup` steps are not timed (compilation, allocator growth, the sampler's standby copy).

The model has Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
vocabulary 151,936, tied embeddings: 494M parameters) with random weights, built here and saved to
`--model-dir`. Its tokenizer is the built-in character tokenizer (nothing is downloaded): only the
prompts' ids depend on it, while the vocabulary, and with it the parameter count, the size of every
weight sync and the cost of the output layer, stays Qwen's. A random model almost never samples
its end token, so every response runs to `--max-tokens`: each step has the same shape.

    python -m bench.verl_gpu --json $OUT/verl_gpu.json                        (a CUDA machine)
    python -m bench.verl_gpu --device cpu --tiny --json runs/verl_gpu_cpu.json  (same path, CPU)
    python -m bench.verl_gpu --backend local --json $OUT/local_gpu.json       (the local backend)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torchkit.builtin import BUILTIN_SIZES, build_tokenizer, save_policy
from unified.rollout import SamplingEngine

# Qwen2-0.5B's config.json, less what only matters past our 512-token sequences.
QWEN2_0_5B: dict[str, Any] = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151_936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
# The built-in tiny model, with a vocabulary larger than the tokenizer's like Qwen2-0.5B's.
TINY: dict[str, Any] = {
    **BUILTIN_SIZES["tiny"],
    "vocab_size": 1024,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
}
SYNC_SHARE_TARGET = 0.05  # issue 11: time/sync under 5% of the step time on the GPU run
_SHAPE_FILE = "bench_shape.json"


def build_model(directory: Path, shape: dict[str, Any], device: str) -> tuple[int, float]:
    """A random-init Qwen2 of `shape` with the built-in tokenizer in `directory` (reused when its
    shape matches); its parameter count and the seconds it took (0 when reused)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    started = time.perf_counter()
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        **shape,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        attn_implementation="sdpa",
    )
    recorded = directory / _SHAPE_FILE
    if recorded.is_file() and json.loads(recorded.read_text()) == shape:
        with torch.device("meta"):
            count = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
        return count, 0.0
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    # Saved in bf16 like Qwen's release; the sampler and verl's workers load it in fp32.
    save_policy(model.to(torch.bfloat16), tokenizer, directory)
    recorded.write_text(json.dumps(shape))
    return count, time.perf_counter() - started


def process_memory(_worker: object = None) -> dict[str, float | None]:
    """Peak memory of the calling process: accelerator (allocated, reserved) and host RSS, GiB.

    Runs in this process and, through Ray's `__ray_call__`, inside each training worker.
    """
    import resource

    import torch

    gib = 2.0**30
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "max_allocated_gib": torch.cuda.max_memory_allocated() / gib if cuda else None,
        "max_reserved_gib": torch.cuda.max_memory_reserved() / gib if cuda else None,
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib,
    }


def run_config(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> Any:
    """The run's `TrainerConfig`: countdown-shaped, on `args.backend` at `args.device`."""
    from unified.config import load_config

    verl = {
        "device": args.device,
        "num_workers": args.workers,
        "forward_batch_size": args.micro_batch_size,
        "param_dtype": args.param_dtype,
        "max_batch": args.batch_size * args.group_size,
        "call_timeout_s": args.timeout_s,
    }
    local = {
        "device": args.device,
        "forward_batch_size": args.micro_batch_size,
        "max_batch": args.batch_size * args.group_size,
    }
    return load_config(
        {
            "name": f"bench-{args.backend}-gpu",
            "backend": args.backend,
            "mode": "sync",
            "workflow": "examples.countdown.workflow:CountdownWorkflow",
            "model": str(model_dir),
            "data": {"train": {"generator": "examples.countdown.tasks:make_tasks", "n": 64}},
            "trainer": {
                "total_steps": args.warmup + args.steps,
                "batch_size": args.batch_size,
                "group_size": args.group_size,
                "lr": 1e-5,
                "kl_coef": args.kl_coef,
                "entropy_coef": 0.0,
                "filter_groups": False,
                "eval_every": 0,
                "save_every": 0,
            },
            "sampling": {"train": {"temperature": 1.0, "max_tokens": args.max_tokens}},
            args.backend: verl if args.backend == "verl" else local,
            "logging": {"run_dir": str(run_dir), "console": False},
        }
    )


async def sample_groups(backend: Any, args: argparse.Namespace, step: int) -> tuple[list[Any], int]:
    """One step's groups sampled by the backend's sampler (advantages +-1), and their tokens."""
    from examples.countdown.tasks import make_tasks
    from examples.countdown.workflow import CountdownWorkflow
    from unified.types import Episode, Step, Trajectory, TrajectoryGroup

    engine = SamplingEngine(backend.token_sampler())
    workflow = CountdownWorkflow()
    tasks = make_tasks(args.batch_size, seed=step)
    prompts = [engine.encode_chat(workflow.messages(task)) for task in tasks]
    n = args.group_size
    calls = [
        engine.complete(
            prompts[i // n], temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, stop=[], seed=i
        )
        for i in range(len(tasks) * n)
    ]
    async with asyncio.timeout(args.timeout_s):
        outputs = await asyncio.gather(*calls)
    groups = []
    for g, task in enumerate(tasks):
        episodes = [
            Episode(
                task_id=task.id,
                rollout_index=i,
                trajectories=[Trajectory(steps=[Step(output=outputs[g * n + i])], reward=0.0)],
            )
            for i in range(n)
        ]
        groups.append(
            TrajectoryGroup(
                task_id=task.id,
                episodes=episodes,
                advantages=[(-1.0) ** i for i in range(n)],
                policy_version=step,
                group_id=f"s{step}-g{g}",
            )
        )
    tokens = sum(len(o.prompt_ids) + len(o.completion_ids) for o in outputs)
    return groups, tokens


async def measure(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """Set the backend up, run warm-up and timed steps, read every process's peak memory."""
    backend: Any
    if args.backend == "verl":
        from backends.verl.backend import VerlBackend

        backend = VerlBackend()
    else:
        from backends.local.backend import LocalBackend

        backend = LocalBackend()
    sync: dict[str, Any] | None = None
    worker_memory: list[dict[str, float | None]] = []
    steps: list[dict[str, float]] = []
    try:
        started = time.perf_counter()
        await backend.setup(run_config(args, model_dir, run_dir))
        setup_s = time.perf_counter() - started
        for step in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            groups, tokens = await sample_groups(backend, args, step)
            t1 = time.perf_counter()
            await backend.forward_backward(groups)
            metrics = await backend.optim_step()
            t2 = time.perf_counter()
            await backend.on_policy_updated(step + 1)
            t3 = time.perf_counter()
            timing = {
                "time/step": t3 - t0,
                "time/generate": t1 - t0,
                "time/train": t2 - t1,
                "time/sync": t3 - t2,
                "tokens": float(tokens),
                "train/grad_norm": metrics.get("train/grad_norm", float("nan")),
            }
            label = "warm-up" if step < args.warmup else "timed"
            print(
                f"step {step} ({label}): "
                + "  ".join(f"{k} {v:.3f}" for k, v in timing.items() if k.startswith("time/")),
                flush=True,
            )
            if step >= args.warmup:
                steps.append(timing)
        if args.backend == "verl":
            import ray

            version = args.warmup + args.steps + 1
            sync = await sync_breakdown(backend, args.timeout_s, version=version)
            workers = backend.group.group.workers
            refs = [handle.__ray_call__.remote(process_memory) for handle in workers]
            worker_memory = await asyncio.to_thread(ray.get, refs, timeout=args.timeout_s)
    finally:
        await backend.shutdown()
    return {"setup_s": setup_s, "steps": steps, "sync": sync, "workers_memory": worker_memory}


def export_in_worker(worker: Any, dtype: str | None) -> float:
    """Seconds a worker takes to gather and copy out the full weights in `dtype` (run through
    Ray's `__ray_call__` on every worker at once: the gather is collective), none sent back."""
    started = time.perf_counter()
    worker.export_weights(dtype=dtype)
    return time.perf_counter() - started


async def sync_breakdown(backend: Any, timeout_s: float, *, version: int) -> dict[str, Any]:
    """One more weight sync in its parts, as `on_policy_updated` makes it: the workers gather the
    weights, Ray brings them to this process, the sampler loads them."""
    import ray
    import torch

    workers = backend.group.group.workers
    async with asyncio.timeout(timeout_s):
        dtype = str(backend.sync_dtype).removeprefix("torch.") if backend.sync_dtype else None
        refs = [handle.__ray_call__.remote(export_in_worker, dtype) for handle in workers]
        in_worker_s = max(await asyncio.to_thread(ray.get, refs, timeout=timeout_s))
        started = time.perf_counter()
        export = backend.group.export_weights
        weights = await asyncio.to_thread(export, backend.tied, backend.sync_dtype)
        exported = time.perf_counter()
        await asyncio.to_thread(backend.sampler.load_weights, weights, version)
        loaded = time.perf_counter()
        # What was sent is the master weights, cast to the sync's dtype, to the bit.
        master = await asyncio.to_thread(export, backend.tied)
    cast = backend.sync_dtype
    exact = all(torch.equal(w, master[n].to(cast or master[n].dtype)) for n, w in weights.items())
    return {
        "sent_equals_master": exact,
        "gather_in_worker_s": in_worker_s,
        "export_s": exported - started,
        "load_s": loaded - exported,
        # Tied names come back as the tensor they alias: count each tensor once.
        "bytes": sum(
            t.numel() * t.element_size() for t in {id(t): t for t in weights.values()}.values()
        ),
        "dtypes": sorted({str(t.dtype) for t in weights.values()}),
    }


def summarise(figures: dict[str, Any]) -> dict[str, Any]:
    """Medians over the timed steps and the ratios the issue's target is stated in."""
    steps = figures["steps"]
    median = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    share = median["time/sync"] / median["time/step"]
    return {
        "median": median,
        "sync_share_of_step": share,
        "sync_share_of_train": median["time/sync"] / median["time/train"],
        "generate_share_of_step": median["time/generate"] / median["time/step"],
        "train_share_of_step": median["time/train"] / median["time/step"],
        "tokens_per_s": median["tokens"] / median["time/step"],
        "sync_share_target": SYNC_SHARE_TARGET,
        "sync_share_met": share < SYNC_SHARE_TARGET,
    }


def report(figures: dict[str, Any]) -> None:
    summary = figures["summary"]
    median = summary["median"]
    print(
        f"{figures['backend']}: model {figures['parameters'] / 1e6:.1f}M parameters on "
        f"{figures['device']} "
        f"({figures['device_name']}); {figures['workers']} worker(s); "
        f"{figures['rollouts_per_step']} rollouts x {figures['max_tokens']} tokens per step"
    )
    print(
        f"build {figures['build_s']:.1f} s   setup {figures['setup_s']:.1f} s   "
        f"median over {len(figures['steps'])} steps:"
    )
    for key in ("time/step", "time/generate", "time/train", "time/sync"):
        print(f"  {key:14} {median[key]:8.3f} s   ({median[key] / median['time/step']:6.1%})")
    verdict = "met" if summary["sync_share_met"] else "NOT met"
    print(
        f"time/sync share of step {summary['sync_share_of_step']:.2%} "
        f"(target < {SYNC_SHARE_TARGET:.0%}: {verdict}); "
        f"of train {summary['sync_share_of_train']:.2%}; "
        f"{summary['tokens_per_s']:.0f} tokens/s"
    )
    sync = figures["sync"]
    if sync is not None:
        print(
            f"  one more sync: from the workers {sync['export_s']:.3f} s "
            f"({sync['bytes'] / 2**20:.0f} MiB, {'/'.join(sync['dtypes'])}; of which the gather "
            f"in the worker {sync['gather_in_worker_s']:.3f} s), into the sampler "
            f"{sync['load_s']:.3f} s; sent == master weights cast: {sync['sent_equals_master']}"
        )
    for name, memory in [("driver", figures["driver_memory"])] + [
        (f"worker {rank}", m) for rank, m in enumerate(figures["workers_memory"])
    ]:
        accelerator = (
            f"max allocated {memory['max_allocated_gib']:.2f} GiB, "
            f"reserved {memory['max_reserved_gib']:.2f} GiB"
            if memory["max_allocated_gib"] is not None
            else "no accelerator"
        )
        print(f"  {name:9} {accelerator}; max RSS {memory['max_rss_gib']:.2f} GiB")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["verl", "local"], default="verl")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the built-in tiny shape, small steps")
    parser.add_argument("--model-dir", type=Path, help="default: a directory under the temp dir")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default 151,936; tiny 1,024)")
    parser.add_argument("--workers", type=int, default=1, help="training processes (GPUs)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, help="groups per step (default 8; tiny 2)")
    parser.add_argument("--group-size", type=int, help="rollouts per group (default 8; tiny 4)")
    parser.add_argument("--max-tokens", type=int, help="tokens per response (default 128; tiny 8)")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="sequences per pass")
    parser.add_argument("--param-dtype", choices=["fp32", "bf16"], help="default: the backend's")
    parser.add_argument("--kl-coef", type=float, default=0.05, help="0: no reference model")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of one call")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    small = {"batch_size": 2, "group_size": 4, "max_tokens": 8}
    large = {"batch_size": 8, "group_size": 8, "max_tokens": 128}
    for key, value in (small if args.tiny else large).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backend == "local" and (args.param_dtype or args.workers != 1):
        parser.error("--backend local trains in fp32 in this process: drop --param-dtype/--workers")
    if args.steps < 1:
        parser.error("--steps must be at least 1 (the timed steps)")
    tokens = len(build_tokenizer())
    if args.vocab is not None and args.vocab < tokens:
        parser.error(
            f"--vocab {args.vocab} is below the tokenizer's {tokens} tokens; pass {tokens} or more"
        )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU is visible; use --device cpu --tiny here")
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    shape = TINY if args.tiny else QWEN2_0_5B
    name = "tiny" if args.tiny else "qwen2-0.5b"
    if args.vocab is not None:
        shape = {**shape, "vocab_size": args.vocab}
        name += f"-vocab{args.vocab}"
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"unified-bench-{name}-random"
    parameters, build_s = build_model(model_dir, shape, args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the driver's peak is the sampler's, not the build's
    print(f"model {name}: {parameters / 1e6:.1f}M parameters in {model_dir}", flush=True)
    with tempfile.TemporaryDirectory() as run_dir:
        figures = asyncio.run(measure(args, model_dir, Path(run_dir)))
    cuda = args.device == "cuda"
    figures |= {
        "backend": args.backend,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "model": name,
        "shape": shape,
        "parameters": parameters,
        "build_s": build_s,
        "workers": args.workers,
        "rollouts_per_step": args.batch_size * args.group_size,
        "max_tokens": args.max_tokens,
        "kl_coef": args.kl_coef,
        "micro_batch_size": args.micro_batch_size,
        "param_dtype": (
            "fp32" if args.backend == "local" else args.param_dtype or ("bf16" if cuda else "fp32")
        ),
        "driver_memory": process_memory(),
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
    }
    figures["summary"] = summarise(figures)
    report(figures)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
