"""Weights into vLLM through shared memory: one file both processes map, no serialisation.

vLLM runs its model in a child process, so new weights must cross a process boundary. The
trainer's side (`SharedWeights`) copies a state dict into a file in `/dev/shm` that it keeps for
the sampler's life (the pages are allocated once; each sync is one copy per tensor, converting
to the engine's dtype on the way). The engine's side (`WeightsReceiver`, mixed into vLLM's
worker through `worker_extension_cls`) maps the same file and hands vLLM views of it
(`reload_weights(weights_iterator=...)`, vLLM's in-place reload): nothing is written to or read
from a file format, and only a small layout (name, dtype, shape, byte range) goes over vLLM's RPC.

The file is a valid safetensors file (header, then the tensors back to back), so the weights a
sampler uses can be read back with `safetensors.torch.load_file` (checkpoints do).

Invariant: the file is written only while the engine is paused, and read only by the reload that
follows; vLLM copies what it loads into its own (repacked) tensors.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

__all__ = ["Layout", "SharedWeights", "WeightsReceiver"]

Layout = list[tuple[str, str, list[int], int, int]]
"""(name, torch dtype name, shape, first byte, end byte) of each tensor in the file."""

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SharedWeights:
    """The trainer's side: a safetensors file at `path` that `write` fills in place.

    `dtype`: what floating-point tensors are stored as (the engine's dtype: vLLM would convert
    them anyway, and a bfloat16 engine then moves half the bytes).
    """

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        self.path = path
        self.dtype = dtype
        self._key: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] | None = None
        self._buffer: torch.Tensor | None = None  # the whole file, mapped (uint8)
        self._views: dict[str, torch.Tensor] = {}
        self.layout: Layout = []

    def write(self, state_dict: dict[str, torch.Tensor]) -> Layout:
        """Copy `state_dict` into the file (laid out again only when its names, shapes or dtypes
        change); returns the layout the engine's side reads it by. Blocking."""
        # By name: the same weights in another order (read from a file, say) keep the layout.
        key = tuple(sorted((n, self._stored(t), tuple(t.shape)) for n, t in state_dict.items()))
        if key != self._key:
            self._lay_out(key)
        with torch.no_grad():
            for name, tensor in state_dict.items():
                self._views[name].copy_(tensor.detach())
        return self.layout

    def _stored(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if tensor.is_floating_point() else tensor.dtype

    def _lay_out(self, key: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]) -> None:
        # Widest elements first: every tensor then starts at a multiple of its element size
        # (the header is padded to 8 bytes), so each is a plain view of the mapped bytes.
        order = sorted(key, key=lambda entry: -entry[1].itemsize)
        header: dict[str, Any] = {}
        layout: Layout = []
        offset = 0
        for name, dtype, shape in order:
            size = dtype.itemsize * int(torch.Size(shape).numel())
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            layout.append((name, str(dtype).removeprefix("torch."), list(shape), offset, size))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        total = start + offset
        self._buffer = None
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(total)
        buffer = torch.from_file(str(self.path), shared=True, size=total, dtype=torch.uint8)
        self.layout = [
            (n, d, s, start + begin, start + begin + size) for n, d, s, begin, size in layout
        ]
        self._views = {
            name: buffer[begin:end].view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, begin, end in self.layout
        }
        self._buffer = buffer
        self._key = key


class WeightsReceiver:
    """The engine's side, mixed into vLLM's worker (`worker_extension_cls`): reloads the model
    in place from the shared file, by `collective_rpc("load_shared_weights", ...)`."""

    _mapped: tuple[str, int, int, torch.Tensor] | None = None  # path, size, inode, the map

    def load_shared_weights(self, path: str, layout: Layout) -> None:
        """Reload the model from the views of `path` that `layout` names (no copy before
        vLLM's own)."""
        status = os.stat(path)
        key = (path, status.st_size, status.st_ino)
        if self._mapped is None or self._mapped[:3] != key:
            # Kept mapped between syncs: the pages are faulted in once, not at every sync.
            buffer = torch.from_file(path, shared=True, size=status.st_size, dtype=torch.uint8)
            self._mapped = (*key, buffer)
        buffer = self._mapped[3]

        def tensors() -> Any:
            for name, dtype, shape, begin, end in layout:
                yield name, buffer[begin:end].view(getattr(torch, dtype)).view(shape)

        self.model_runner.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
