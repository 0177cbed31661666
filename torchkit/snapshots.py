"""Weight snapshots in checkpoints: tensors safetensors can write, and a sampler's weights.

A backend whose sampler holds its own copy of the weights (local, verl) saves that copy beside
its training state: `sampler.safetensors`, and `backend.json` with the copy's policy version
(`sampler_version`) plus whatever the backend records there. Resuming loads it back as that
version, so a run resumed from a checkpoint samples exactly what it sampled when it was saved.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from torchkit.sampler import BatchingSampler
from torchkit.vllm_engine import VllmSampler

__all__ = [
    "META_FILE",
    "SAMPLER_FILE",
    "contiguous",
    "load_sampler",
    "load_sampler_weights",
    "read_meta",
    "restore_sampler",
    "save_sampler",
]

SAMPLER_FILE = "sampler.safetensors"
META_FILE = "backend.json"


def contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies of `tensors`, as `save_file` takes them."""
    # Clones: safetensors refuses tensors that share storage (tied embeddings do).
    return {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}


def save_sampler(sampler: BatchingSampler | VllmSampler, directory: Path, **meta: Any) -> None:
    """Write the sampler's weights and `backend.json`: `meta` plus their `sampler_version`."""
    weights = sampler.weights() if isinstance(sampler, VllmSampler) else sampler.model.state_dict()
    save_file(contiguous(weights), directory / SAMPLER_FILE)
    record = {**meta, "sampler_version": sampler.version}
    (directory / META_FILE).write_text(json.dumps(record))


def read_meta(directory: Path) -> dict[str, Any]:
    """What `save_sampler` recorded in `directory`'s `backend.json`."""
    meta: dict[str, Any] = json.loads((directory / META_FILE).read_text())
    return meta


def load_sampler(sampler: BatchingSampler, directory: Path, meta: dict[str, Any]) -> None:
    """Load the saved sampler weights into `sampler` as the version `meta` records (blocking)."""
    sampler.load_weights(load_file(directory / SAMPLER_FILE), meta["sampler_version"])


async def load_sampler_weights(
    sampler: BatchingSampler | VllmSampler, weights: dict[str, torch.Tensor], version: int
) -> None:
    """Make `weights` the sampler's policy `version`, from the event loop, on either engine:
    the built-in sampler copies them in a thread, vLLM's load is a coroutine."""
    if isinstance(sampler, VllmSampler):
        await sampler.load_weights(weights, version)
    else:
        await asyncio.to_thread(sampler.load_weights, weights, version)


async def restore_sampler(
    sampler: BatchingSampler | VllmSampler, directory: Path, meta: dict[str, Any]
) -> None:
    """`load_sampler` for either engine, from the event loop."""
    weights = await asyncio.to_thread(load_file, directory / SAMPLER_FILE)
    await load_sampler_weights(sampler, weights, meta["sampler_version"])
