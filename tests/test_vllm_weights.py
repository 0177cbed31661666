"""The shared weights file vLLM reloads from (`torchkit/vllm_weights.py`): what the trainer writes
is what a reader of the file gets, in place across syncs, in the engine's dtype. No vLLM needed:
the engine's side is the same views (`tests/test_vllm_engine.py` runs it in the real engine)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from torchkit.vllm_weights import SharedWeights


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(11, 6, generator=generator),
        "model.layers.0.mlp.down_proj.weight": torch.randn(6, 5, generator=generator),
        "model.norm.weight": torch.randn(6, generator=generator),
        "model.rotary.positions": torch.arange(7),  # an integer buffer: kept as it is
    }


def views(shared: SharedWeights) -> dict[str, torch.Tensor]:
    """The tensors as the engine's side reads them: views of the mapped file by the layout."""
    buffer = torch.from_file(str(shared.path), size=shared.path.stat().st_size, dtype=torch.uint8)
    return {
        name: buffer[begin:end].view(getattr(torch, dtype)).view(shape)
        for name, dtype, shape, begin, end in shared.layout
    }


def test_the_file_holds_the_state_dict_for_both_readers(tmp_path: Path) -> None:
    shared = SharedWeights(tmp_path / "model.safetensors", torch.float32)
    weights = state(0)
    shared.write(weights)
    for reader in (load_file(shared.path), views(shared)):
        assert reader.keys() == weights.keys()
        for name, tensor in weights.items():
            assert torch.equal(reader[name], tensor), name


def test_a_second_sync_rewrites_the_same_file_in_place(tmp_path: Path) -> None:
    shared = SharedWeights(tmp_path / "model.safetensors", torch.float32)
    shared.write(state(0))
    inode, layout = shared.path.stat().st_ino, list(shared.layout)
    shared.write(state(1))
    assert shared.path.stat().st_ino == inode and shared.layout == layout, "laid out once"
    read = views(shared)
    for name, tensor in state(1).items():
        assert torch.equal(read[name], tensor), name


def test_floating_tensors_are_stored_in_the_engines_dtype(tmp_path: Path) -> None:
    shared = SharedWeights(tmp_path / "model.safetensors", torch.bfloat16)
    weights = state(2)
    shared.write(weights)
    read = load_file(shared.path)
    assert read["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(read["model.norm.weight"], weights["model.norm.weight"].bfloat16())
    assert read["model.rotary.positions"].dtype == torch.int64, "integers are not converted"
    assert torch.equal(read["model.rotary.positions"], weights["model.rotary.positions"])
