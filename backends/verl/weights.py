"""The weight sync's transfer: trained weights from the workers to the driver's sampler.

Ray moves numpy arrays out of band (no pickled copy of their bytes), torch tensors in band, so a
worker sends each tensor as a numpy array and the name of its dtype (bf16, which numpy lacks, as
its bits in int16). Names tied to another (an output layer sharing the embedding) are not sent:
the driver refills them from the name they alias. On a GPU the worker copies each tensor into a
pinned host buffer it keeps between syncs (`HostStaging`), all copies in flight at once: a
pageable copy per tensor made the 0.5B sync 10x slower (docs/backends/verl.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["HostStaging", "Wire", "from_wire", "tied_aliases", "to_wire", "with_aliases"]

Wire = tuple[np.ndarray, str]
"""A tensor in transit: its data as a numpy array, and its torch dtype's name."""


def to_wire(tensor: torch.Tensor) -> Wire:
    """A CPU tensor as a numpy array sharing its memory, and its dtype's name."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.contiguous().numpy(), dtype


def from_wire(wire: Wire) -> torch.Tensor:
    """The tensor `to_wire` sent. It may share read-only memory with Ray's object store: copy
    it into a module (`load_state_dict` does), never write to it in place."""
    array, dtype = wire
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


class HostStaging:
    """Host buffers, one per name, that a worker's tensors are copied into before they are sent.

    Kept between syncs, so each is allocated (and pinned, for a GPU's tensors) once; a GPU's copies
    run asynchronously, converting to the wire dtype on the GPU, until `wait`. A buffer is
    overwritten by the next sync: send (Ray copies a return value out) before copying again.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending = False  # an asynchronous (GPU) copy may be in flight

    def copy_in(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """`tensor` (in `dtype` if it is a float tensor, else its own) in `name`'s buffer;
        valid after `wait`. The buffers stay allocated (pinned) for the next sync: a copy of
        the weights in host memory on the rank that sends them."""
        dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != dtype:
            buffer = torch.empty(tensor.shape, dtype=dtype, pin_memory=tensor.is_cuda)
            self._buffers[name] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        self._pending |= tensor.is_cuda
        return buffer

    def wait(self) -> None:
        """Block until every copy made so far has landed."""
        if self._pending:
            torch.cuda.synchronize()
            self._pending = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Names in `model`'s state dict whose tensor is an earlier name's (tied weights), each
    mapped to that earlier name."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def with_aliases(
    weights: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """`weights` plus every alias, pointing at the tensor of the name it is tied to."""
    return {**weights, **{alias: weights[name] for alias, name in aliases.items()}}
