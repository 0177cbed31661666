"""The weight sync's transfer: trained weights from the workers to the driver's sampler.

Ray moves numpy arrays out of band (no pickled copy of their bytes), torch tensors in band, so a
worker sends each tensor as a numpy array and the name of its dtype (bf16, which numpy lacks, as
its bits in int16). Names tied to another (an output layer sharing the embedding) are not sent:
the driver refills them from the name they alias.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["Wire", "from_wire", "tied_aliases", "to_wire", "with_aliases"]

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
