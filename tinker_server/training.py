"""One LoRA training model of the local Tinker server: Tinker's losses, AdamW, saved state.

Semantics follow the service: position i of a datum's input predicts `target_tokens[i]`; every
loss is a token-level **sum** (`loss:sum`), with per-token `advantages` (0 on prompt positions)
and per-token `weights` for `cross_entropy`. `cross_entropy` also takes soft targets, `(N, K)`
`target_tokens` and `weights` (tinker-cookbook's distillation recipes): position i's loss is
`-sum_k weights[i, k] * logp(target_tokens[i, k])`, and the datum's output `logprobs` is `(N, K)`,
the logprob of each target. The service's code is not public: this is what the SDK's
`forward_backward_custom` and the cookbook's distillation rely on (docs/backends/tinker.md).
Gradients of several `forward_backward` calls accumulate until `optim_step` (AdamW with the
request's hyperparameters). Scoring, the per-token policy losses and the optimizer step are the
torch kit's (`torchkit.scoring`, `.losses`, `.optim`), as the local backend's. Every method
blocks: the server calls them from a worker thread, one at a time per model.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from tinker_server.wire import WireDatum
from torchkit.lora import LoraTargets, attach_lora, merged_state_dict
from torchkit.losses import per_token_loss
from torchkit.optim import clipped_step
from torchkit.scoring import score_tokens

__all__ = [
    "LOSS_INPUTS",
    "REFUSED_LOSSES",
    "SOFT_TARGET_INPUTS",
    "AdamSettings",
    "LoraSpec",
    "TrainingModel",
    "UserError",
    "dro_loss",
    "gspo_loss",
]

LOSS_INPUTS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"target_tokens", "weights"}),
    "importance_sampling": frozenset({"target_tokens", "logprobs", "advantages"}),
    "ppo": frozenset({"target_tokens", "logprobs", "advantages"}),
    "cispo": frozenset({"target_tokens", "logprobs", "advantages"}),
    "dro": frozenset({"target_tokens", "logprobs", "advantages"}),
    "gspo": frozenset({"target_tokens", "logprobs", "advantages"}),
}
"""The loss functions the server runs and the `loss_fn_inputs` each one requires."""

OPTIONAL_INPUTS: dict[str, frozenset[str]] = {"gspo": frozenset({"sequence_ratio_mask"})}
"""Inputs a loss also takes. `gspo` without `sequence_ratio_mask`: the positions whose sampler
logprob is not 0 (prompt positions carry 0), i.e. the sampled tokens."""

SOFT_TARGET_INPUTS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"target_tokens", "weights"}),
}
"""The inputs that may be `(N, K)`, K targets per position (always together, of one shape); every
other input is `(N,)`."""

REFUSED_LOSSES: dict[str, str] = {
    "stable_reinforce": "its objective is not published (the service computes it from "
    "information it records while sampling); use ppo, cispo or gspo, which are robust "
    "off-policy too",
    "custom": "server-side custom losses are not served; forward_backward_custom runs the "
    "loss on the client and works",
}
"""Losses the SDK names that the server refuses, and why."""

_CLIP_KEYS = frozenset({"clip_low_threshold", "clip_high_threshold"})
_CONFIG_KEYS: dict[str, frozenset[str]] = {"dro": frozenset({"beta"})}
"""`loss_fn_config` keys of each loss (default: the clip thresholds)."""

_MICRO_BATCH = 64


class UserError(ValueError):
    """The request is wrong (bad loss, inputs, path); answered as a `user` error future."""


@dataclass(frozen=True)
class LoraSpec:
    """How a model's adapters are shaped: rank, seed and the layer families they cover."""

    rank: int
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamSettings:
    """One `optim_step`'s AdamW hyperparameters (`tinker.AdamParams`)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class TrainingModel:
    """A copy of the base model with LoRA adapters, its optimizer and accumulated gradients."""

    def __init__(self, base: PreTrainedModel, lora: LoraSpec) -> None:
        self.lora = lora
        self.model = copy.deepcopy(base).train(False)
        targets = LoraTargets(attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed)
        adapters = attach_lora(self.model, lora.rank, targets, seed=lora.seed)
        self.parameters = {
            f"{name}.{part}": getattr(adapter, part)
            for name, adapter in adapters.items()
            for part in ("lora_A", "lora_B")
        }
        self.optimizer = torch.optim.AdamW(list(self.parameters.values()), lr=1e-4)
        self.device = next(self.model.parameters()).device

    # -- training -----------------------------------------------------------------------------

    def forward_backward(
        self,
        data: list[WireDatum],
        loss_fn: str,
        loss_fn_config: dict[str, float],
        *,
        forward_only: bool,
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Per-datum logprobs of the target tokens and `loss:sum`; accumulates gradients."""
        settings = _settings(loss_fn, loss_fn_config)
        vocab_size = int(self.model.config.vocab_size)
        for i, datum in enumerate(data):
            _check_datum(i, datum, loss_fn, vocab_size)
        outputs: list[np.ndarray] = []
        loss_sum = 0.0
        for start in range(0, len(data), _MICRO_BATCH):
            chunk = data[start : start + _MICRO_BATCH]
            with torch.set_grad_enabled(not forward_only):
                logp_D = self._target_logprobs(chunk)
                loss = self._loss(chunk, loss_fn, logp_D, settings)
                if not forward_only and loss.requires_grad:
                    loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += float(loss.detach())
            outputs += [logp.detach().float().cpu().numpy().copy() for logp in logp_D]
        return outputs, {"loss:sum": loss_sum}

    def _target_logprobs(self, chunk: list[WireDatum]) -> list[torch.Tensor]:
        """Each datum's logprobs of its target tokens (position i predicts `target_tokens[i]`),
        shaped as its `target_tokens`: `(N,)`, or `(N, K)` for K soft targets per position."""
        width = max(len(d.tokens) for d in chunk)
        ids_BL = torch.zeros(len(chunk), width, dtype=torch.long)
        targets_BL = torch.zeros(len(chunk), width, dtype=torch.long)
        mask_BL = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, d in enumerate(chunk):
            n = len(d.tokens)
            targets = d.inputs["target_tokens"].astype(np.int64)
            ids_BL[b, :n] = torch.from_numpy(d.tokens)
            targets_BL[b, :n] = torch.from_numpy(targets if targets.ndim == 1 else targets[:, 0])
            mask_BL[b, :n] = 1
        ids_BL, targets_BL, mask_BL = (t.to(self.device) for t in (ids_BL, targets_BL, mask_BL))
        valid_BL = mask_BL.bool()
        rows_T, positions_T = valid_BL.nonzero(as_tuple=True)  # row-major: datum order
        scores = score_tokens(
            self.model,
            ids_BL,
            rows_T,
            positions_T,
            targets_BL[valid_BL],
            attention_mask_BL=mask_BL,
        )
        lengths = [len(d.tokens) for d in chunk]
        logp_D: list[torch.Tensor] = []
        for d, logp_N, log_probs_NV in zip(
            chunk,
            torch.split(scores.logp_T, lengths),
            torch.split(scores.log_probs_TV, lengths),
            strict=True,
        ):
            targets = d.inputs["target_tokens"]
            if targets.ndim == 2:
                targets_NK = torch.from_numpy(targets.astype(np.int64)).to(self.device)
                logp_D.append(log_probs_NV.gather(1, targets_NK))
            else:
                logp_D.append(logp_N)
        return logp_D

    def _loss(
        self,
        chunk: list[WireDatum],
        loss_fn: str,
        logp_D: list[torch.Tensor],
        settings: _Settings,
    ) -> torch.Tensor:
        def flat(name: str) -> torch.Tensor:
            values = np.concatenate([d.inputs[name].reshape(-1) for d in chunk])
            return torch.from_numpy(values.astype(np.float32)).to(self.device)

        logp_T = torch.cat([logp.reshape(-1) for logp in logp_D])
        if loss_fn == "cross_entropy":
            return -(flat("weights") * logp_T).sum()
        old_T, adv_T = flat("logprobs"), flat("advantages")
        if loss_fn == "dro":
            return dro_loss(logp_T, old_T, adv_T, beta=settings.beta)
        if loss_fn == "gspo":
            masks = [
                d.inputs.get("sequence_ratio_mask", (d.inputs["logprobs"] != 0).astype(np.float32))
                for d in chunk
            ]
            mask_T = torch.from_numpy(np.concatenate(masks).astype(np.float32)).to(self.device)
            lengths = torch.tensor([len(d.tokens) for d in chunk], device=self.device)
            row_T = torch.repeat_interleave(torch.arange(len(chunk), device=self.device), lengths)
            return gspo_loss(
                logp_T, old_T, adv_T, mask_T, row_T, low=settings.low, high=settings.high
            )
        terms = per_token_loss(loss_fn, logp_T, old_T, adv_T, clip_ratio=settings.high - 1.0)
        return terms.loss_T.sum()

    def optim_step(self, adam: AdamSettings) -> dict[str, float]:
        """One AdamW step on the accumulated gradients, then clear them."""
        params = [p for p in self.parameters.values() if p.grad is not None]
        if not params:
            return {"grad_norm": 0.0}
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        norm_limit = adam.grad_clip_norm if adam.grad_clip_norm > 0 else None
        step = clipped_step(self.optimizer, params, max_grad_norm=norm_limit)
        if step.skipped:
            raise UserError(f"gradient norm is {step.grad_norm}; lower the learning rate")
        return {"grad_norm": step.grad_norm}

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The base weights with the adapters folded in: what a sampler of this model loads."""
        return merged_state_dict(self.model)

    # -- saved state --------------------------------------------------------------------------

    def save(self, directory: Path, *, base_model: str, optimizer: bool) -> None:
        """Write the adapters (and the optimizer state) and their shape into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"adapter.{k}": v.detach().cpu().contiguous() for k, v in self.parameters.items()
        }
        meta: dict[str, Any] = {"base_model": base_model, "lora": self.lora.__dict__}
        if optimizer:
            names = {id(p): k for k, p in self.parameters.items()}
            for param, state in self.optimizer.state.items():
                for key, value in state.items():
                    tensors[f"optimizer.{names[id(param)]}.{key}"] = value.detach().cpu().clone()
            meta["param_groups"] = [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ]
        save_file(tensors, str(directory / "state.safetensors"))
        (directory / "meta.json").write_text(json.dumps(meta))

    @staticmethod
    def read_meta(directory: Path) -> dict[str, Any]:
        """The base model and LoRA shape a saved state was made with."""
        path = directory / "meta.json"
        if not path.is_file():
            raise UserError(f"no saved state at {directory}")
        meta: dict[str, Any] = json.loads(path.read_text())
        return meta

    def load(self, directory: Path, *, optimizer: bool) -> None:
        """Restore the adapters (and the optimizer state if asked and saved) from `directory`."""
        tensors = load_file(str(directory / "state.safetensors"), device=str(self.device))
        with torch.no_grad():
            for key, param in self.parameters.items():
                param.copy_(tensors[f"adapter.{key}"])
        if not optimizer:
            return
        meta = self.read_meta(directory)
        if "param_groups" not in meta:
            raise UserError(f"the state at {directory} was saved without optimizer state")
        for key, param in self.parameters.items():
            prefix = f"optimizer.{key}."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                self.optimizer.state[param] = state
        for group, saved in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})


@dataclass(frozen=True)
class _Settings:
    """A loss's `loss_fn_config`, checked: clip bounds of the ratio, DRO's beta."""

    low: float = 0.8
    high: float = 1.2
    beta: float = 0.0


def _settings(loss_fn: str, config: dict[str, float]) -> _Settings:
    if loss_fn in REFUSED_LOSSES:
        raise UserError(f"loss_fn {loss_fn!r} is not served here: {REFUSED_LOSSES[loss_fn]}")
    if loss_fn not in LOSS_INPUTS:
        supported = ", ".join(sorted(LOSS_INPUTS))
        raise UserError(f"loss_fn {loss_fn!r} is not served here; supported: {supported}")
    allowed = _CONFIG_KEYS.get(loss_fn, _CLIP_KEYS)
    unknown = set(config) - allowed
    if unknown:
        raise UserError(
            f"loss_fn_config keys {sorted(unknown)} are not supported by {loss_fn!r} "
            f"(it takes {sorted(allowed)})"
        )
    if loss_fn == "dro":
        if "beta" not in config:
            raise UserError("loss 'dro' needs loss_fn_config={'beta': ...}")
        return _Settings(beta=float(config["beta"]))
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    if not low < 1.0 < high:
        raise UserError(f"clip thresholds ({low}, {high}) must satisfy low < 1 < high")
    symmetric = math.isclose(1.0 - low, high - 1.0, abs_tol=1e-6)
    if loss_fn in ("ppo", "cispo", "importance_sampling") and not symmetric:
        raise UserError(
            f"clip thresholds ({low}, {high}) must be symmetric around 1 for {loss_fn!r} "
            "on the local server"
        )
    return _Settings(low=low, high=high)


def dro_loss(
    logp_T: torch.Tensor, old_T: torch.Tensor, adv_T: torch.Tensor, *, beta: float
) -> torch.Tensor:
    """Tinker's `dro`: `-sum(logp * A - beta / 2 * (logp - q)^2)`."""
    return -(logp_T * adv_T - 0.5 * beta * (logp_T - old_T) ** 2).sum()


def gspo_loss(
    logp_T: torch.Tensor,
    old_T: torch.Tensor,
    adv_T: torch.Tensor,
    mask_T: torch.Tensor,
    row_T: torch.Tensor,
    *,
    low: float,
    high: float,
) -> torch.Tensor:
    """Tinker's `gspo` (GSPO-token): each datum's ratio is the geometric mean of its masked
    tokens' ratios; every token carries that value with its own logprob's gradient, clipped
    PPO-style: `-sum(min(s_t * A_t, clip(s_t, low, high) * A_t))`."""
    rows = int(row_T.max()) + 1 if row_T.numel() else 0
    gap_T = (logp_T.detach() - old_T) * mask_T
    count_R = torch.zeros(rows, device=logp_T.device).index_add_(0, row_T, mask_T)
    total_R = torch.zeros(rows, device=logp_T.device).index_add_(0, row_T, gap_T)
    log_ratio_R = total_R / count_R.clamp(min=1.0)
    ratio_T = torch.exp(log_ratio_R[row_T] + logp_T - logp_T.detach())
    return -torch.minimum(ratio_T * adv_T, ratio_T.clamp(low, high) * adv_T).sum()


def _check_datum(index: int, datum: WireDatum, loss_fn: str, vocab_size: int) -> None:
    wanted = LOSS_INPUTS[loss_fn]
    optional = OPTIONAL_INPUTS.get(loss_fn, frozenset())
    got = set(datum.inputs)
    if not wanted <= got <= wanted | optional:
        also = f" (and optionally {sorted(optional)})" if optional else ""
        raise UserError(
            f"datum {index}: loss {loss_fn!r} takes loss_fn_inputs {sorted(wanted)}{also}, "
            f"got {sorted(got)}"
        )
    n = len(datum.tokens)
    if n == 0:
        raise UserError(f"datum {index} has an empty model_input")
    for name, values in datum.inputs.items():
        if len(values) != n:
            raise UserError(
                f"datum {index}: loss_fn_inputs[{name!r}] has shape {values.shape} for {n} "
                f"input tokens; its first dimension must be {n}, one entry per input position"
            )
    _check_soft_targets(index, datum, loss_fn)
    targets = datum.inputs["target_tokens"]
    outside = targets[(targets < 0) | (targets >= vocab_size)]
    if outside.size:
        raise UserError(
            f"datum {index}: target_tokens holds {int(outside[0])}, outside the model's "
            f"vocabulary [0, {vocab_size}); drop or remap that token"
        )


def _check_soft_targets(index: int, datum: WireDatum, loss_fn: str) -> None:
    """Only a loss's `SOFT_TARGET_INPUTS` may be `(N, K)`, all of one shape, K at least 1."""
    soft = SOFT_TARGET_INPUTS.get(loss_fn, frozenset())
    shapes = {name: values.shape for name, values in datum.inputs.items()}
    for name, shape in shapes.items():
        if len(shape) == 2 and name not in soft:
            takes = (
                f"only {sorted(soft)} take (N, K) soft targets"
                if soft
                else f"loss {loss_fn!r} takes no (N, K) inputs"
            )
            raise UserError(
                f"datum {index}: loss_fn_inputs[{name!r}] has shape {shape}; {takes}: "
                f"send ({shape[0]},)"
            )
    soft_shapes = {shapes[name] for name in soft if name in shapes}
    if len(soft_shapes) > 1:
        listed = " vs ".join(f"{name} {shapes[name]}" for name in sorted(soft))
        raise UserError(
            f"datum {index}: shapes differ, {listed}; send both (N,) or both (N, K) with one "
            "K (pad a position's unused targets with weight 0)"
        )
    if any(len(shape) == 2 and shape[1] == 0 for shape in soft_shapes):
        raise UserError(
            f"datum {index}: soft targets of shape {soft_shapes.pop()} have K = 0; "
            "send at least one target per position"
        )
