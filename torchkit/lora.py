"""LoRA adapters (the Tinker-compatible server's, and the local backend's `local.lora_rank`):
train low-rank deltas, sample merged weights.

`attach_lora` swaps the chosen `nn.Linear` layers of a causal LM for `LoraLinear`s that keep the
base weight frozen under its original name and add `scale * B @ A` (A: rank x in, Gaussian;
B: out x rank, zeros, so a fresh adapter leaves the model unchanged). Only A and B train.
`merged_state_dict` folds the adapters into plain weights with the original keys, which is what
the sampler loads: sampling costs the same as the base model. Invariant: the model with adapters
and the merged weights give the same logits up to float rounding.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from transformers import PreTrainedModel

__all__ = [
    "LORA_ALPHA",
    "LoraLinear",
    "LoraTargets",
    "attach_lora",
    "merged_copy",
    "merged_state_dict",
    "targeted_layers",
    "untied_copy",
]

LORA_ALPHA = 32.0
"""The adapter's output is scaled by `LORA_ALPHA / rank`, so the learning rate barely depends on
the rank (the usual LoRA convention)."""

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class LoraTargets:
    """Which layer families get adapters (Tinker's `train_attn`, `train_mlp`, `train_unembed`)."""

    def __init__(self, *, attn: bool = True, mlp: bool = True, unembed: bool = True) -> None:
        self.attn, self.mlp, self.unembed = attn, mlp, unembed

    def wants(self, name: str) -> bool:
        """Whether the module at dotted `name` gets an adapter."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lm_head":
            return self.unembed
        return (self.attn and leaf in _ATTENTION) or (self.mlp and leaf in _MLP)


class LoraLinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank delta: `W x + b + scale * B A x`."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        # Under the base layer's names, so the state-dict keys of the base weights are unchanged;
        # copies, so a tied embedding the base weight shared is left as it is.
        self.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
        self.bias = (
            nn.Parameter(base.bias.detach().clone(), requires_grad=False)
            if base.bias is not None
            else None
        )
        self.scale = LORA_ALPHA / rank
        std = 1.0 / math.sqrt(self.in_features)
        a = torch.randn(rank, self.in_features, generator=generator) * std
        self.lora_A = nn.Parameter(a.to(base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = functional.linear(functional.linear(x, self.lora_A), self.lora_B)
        return functional.linear(x, self.weight, self.bias) + self.scale * delta

    def merged_weight(self) -> torch.Tensor:
        """The plain weight this layer computes with: `W + scale * B A`."""
        return self.weight + self.scale * (self.lora_B @ self.lora_A)


def targeted_layers(model: nn.Module, targets: LoraTargets) -> list[str]:
    """The names of `model`'s linear layers that `targets` gives adapters, in module order."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and targets.wants(name)
    ]


def attach_lora(
    model: nn.Module, rank: int, targets: LoraTargets, *, seed: int = 0
) -> dict[str, LoraLinear]:
    """Replace the targeted linear layers of `model` by adapters (in place); freeze the rest.

    Returns the adapters by module name. The output layer's adapter holds its own copy of the
    weight, so it changes the unembedding only, as on the service; a model saved or synced from
    the merged weights must be untied (`untied_copy`).
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    adapters: dict[str, LoraLinear] = {}
    for name in targeted_layers(model, targets):
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)
        adapter = LoraLinear(module, rank, generator).to(module.weight.device)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, adapter)
        adapters[name] = adapter
    if not adapters:
        raise ValueError("no layer of the model matches the LoRA targets")
    return adapters


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter folded in, under the plain model's keys."""
    with torch.no_grad():
        merged: dict[str, torch.Tensor] = {}
        for key, value in model.state_dict().items():
            if key.endswith((".lora_A", ".lora_B")):
                continue
            merged[key] = value.detach().clone()
        for name, module in model.named_modules():
            if isinstance(module, LoraLinear):
                merged[f"{name}.weight"] = module.merged_weight().detach().clone()
        return merged


def merged_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain copy of `model` with every adapter folded into its layer: what an export saves.

    Its output layer is untied from the embedding when it had an adapter (else a reload would
    tie the merged unembedding back to the embedding)."""
    plain = copy.deepcopy(model)
    for name, module in list(plain.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        layer = nn.utils.skip_init(  # type: ignore[no-untyped-call]  # no random init: copied in
            nn.Linear,
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        if name.rsplit(".", 1)[-1] == "lm_head":
            plain.config.tie_word_embeddings = False
        with torch.no_grad():
            layer.weight.copy_(module.merged_weight())
            if module.bias is not None:
                layer.bias.copy_(module.bias)
        parent_name, _, leaf = name.rpartition(".")
        setattr(plain.get_submodule(parent_name) if parent_name else plain, leaf, layer)
    return plain


def untied_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy whose output layer owns its weight, so merged unembedding adapters can load."""
    template = copy.deepcopy(model).train(False)
    lm_head: Any = template.get_output_embeddings()
    if lm_head is not None:
        lm_head.weight = torch.nn.Parameter(lm_head.weight.detach().clone())
        template.config.tie_word_embeddings = False
    return template
