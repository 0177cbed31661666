"""The weight sync's transfer form: tensors as numpy arrays through Ray, tied names left out."""

from __future__ import annotations

import pickle

import pytest
import torch

from backends.local.builtin import load_policy
from backends.verl.weights import from_wire, tied_aliases, to_wire, with_aliases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tensor_comes_back_bit_for_bit_after_the_wire(dtype: torch.dtype) -> None:
    tensor = torch.randn(3, 5).to(dtype)
    # Through pickle protocol 5, as Ray serialises a worker's return value.
    back = from_wire(pickle.loads(pickle.dumps(to_wire(tensor), protocol=5)))
    assert back.dtype == dtype and torch.equal(back, tensor)


def test_tied_names_are_found_left_out_and_refilled() -> None:
    model, _ = load_policy("builtin:tiny")
    aliases = tied_aliases(model)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    state = model.state_dict()
    sent = {name: t for name, t in state.items() if name not in aliases}
    refilled = with_aliases(sent, aliases)
    assert refilled.keys() == state.keys()
    assert refilled["lm_head.weight"] is refilled["model.embed_tokens.weight"]
    model.load_state_dict(refilled)  # strict: every name present
