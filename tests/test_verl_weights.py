"""The weight sync's transfer form: tensors as numpy arrays through Ray, tied names left out."""

from __future__ import annotations

import pickle

import pytest
import torch

from backends.verl.weights import HostStaging, from_wire, tied_aliases, to_wire, with_aliases
from torchkit.builtin import load_policy
from torchkit.sampler import copy_weights


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


def test_host_staging_casts_into_one_buffer_per_name_kept_between_syncs() -> None:
    staging = HostStaging()
    weight = torch.randn(4, 6)
    first = staging.copy_in("w", weight, torch.bfloat16)
    staging.wait()
    assert first.dtype == torch.bfloat16 and torch.equal(first, weight.to(torch.bfloat16))
    moved = weight * 3
    second = staging.copy_in("w", moved, torch.bfloat16)
    staging.wait()
    assert second is first, "the next sync reuses the buffer"
    assert torch.equal(second, moved.to(torch.bfloat16))
    assert torch.equal(staging.copy_in("b", weight, None), weight), "None keeps the dtype"
    steps = torch.arange(3)
    assert staging.copy_in("n", steps, torch.bfloat16).dtype == torch.int64, "floats only"
    assert staging.nbytes == weight.numel() * (2 + 4) + 3 * 8


def test_copy_weights_loads_bf16_values_into_an_fp32_model_and_refuses_a_wrong_shape() -> None:
    model, _ = load_policy("builtin:tiny")
    source, _ = load_policy("builtin:tiny", seed=1)
    sent = {name: t.to(torch.bfloat16) for name, t in source.state_dict().items()}
    with torch.no_grad():
        copy_weights(model, sent)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, sent[name].float()), name
    name = next(iter(sent))
    with pytest.raises(RuntimeError, match="size mismatch"):
        copy_weights(model, {**sent, name: sent[name][:1]})
    with pytest.raises(RuntimeError, match="Missing key"):
        copy_weights(model, {k: v for k, v in sent.items() if k != name})
