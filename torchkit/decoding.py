"""Incremental decoding over a preallocated KV cache: one batch, one token at a time.

A `Stepper` runs the model for a left-padded batch: `prefill` consumes the prompts and returns
the next-token logits, `step` feeds one token per row and returns the following logits. The fast
path, `Qwen2Stepper`, re-implements the forward of Qwen2/Llama-style models directly over
preallocated key/value tensors; at small model sizes the per-token Python overhead of the generic
Hugging Face path dominates, and this path avoids it; it prefills rows of similar prompt length
together (`prefill_groups`), so a batch mixing short and long prompts is not all padding, and it
takes the keys and values of a prompt's start from an earlier request (`prefixes`, from the
sampler's `PrefixCache`), so an agent's next turn prefills only its new tokens.
`HFStepper` serves every other causal LM.
Both compute in float32 and agree with the model's own full-sequence forward (the trainer's) to
float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from torchkit.prefix_cache import KeyValues

__all__ = [
    "HFStepper",
    "Qwen2Stepper",
    "Stepper",
    "group_overhead",
    "make_stepper",
    "prefill_groups",
]


class Stepper(Protocol):
    """Runs one left-padded batch through the model token by token."""

    reuses_prefixes: bool  # whether `prefill` takes `prefixes` and `saved` gives them

    def prefill(
        self,
        ids_BL: torch.Tensor,
        mask_BL: torch.Tensor,
        prefixes: Sequence[KeyValues | None] | None = None,
    ) -> torch.Tensor:
        """Consume the prompts; return the logits of the next token, [B, V]. `prefixes[r]`, if
        given, holds the keys and values of row r's first tokens: only the rest are run."""
        ...

    def saved(self, row: int) -> KeyValues | None:
        """The keys and values of every token row `row` has run so far (None if not kept)."""
        ...

    def step(self, ids_B: torch.Tensor) -> torch.Tensor:
        """Append one token per row; return the logits of the token after it, [B, V]."""
        ...

    def keep(self, rows: torch.Tensor) -> bool:
        """Drop every row not in `rows` from the batch; False if this stepper cannot."""
        ...


def make_stepper(model: PreTrainedModel, batch: int, max_len: int) -> Stepper:
    """The fast stepper for Qwen2/Llama-style models, the generic one for anything else."""
    if Qwen2Stepper.supports(model):
        return Qwen2Stepper(model, batch, max_len)
    return HFStepper(model)


class Qwen2Stepper:
    """Qwen2/Llama forward over a preallocated cache (default RoPE, no sliding window)."""

    reuses_prefixes = True

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
        return (
            cfg.model_type in ("qwen2", "llama")
            and rope.get("rope_type", "default") == "default"
            and not getattr(cfg, "use_sliding_window", False)
            and getattr(cfg, "hidden_act", "silu") == "silu"
            # Llama variants with o_proj or MLP biases take the generic path.
            and not getattr(cfg, "attention_bias", False)
            and not getattr(cfg, "mlp_bias", False)
        )

    def __init__(self, model: PreTrainedModel, batch: int, max_len: int) -> None:
        cfg = model.config
        inner: Any = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head  # type: ignore[attr-defined]
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        self.fused = [_fuse(layer) for layer in self.layers]
        shape = (len(self.layers), batch, self.kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # 0 where a key is visible, -inf where it is padding.
        self.key_bias_BT = torch.zeros(batch, max_len, dtype=dtype, device=device)
        inv_freq = inner.rotary_emb.inv_freq.float()
        positions = torch.arange(max_len, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.length = 0
        self.next_pos_B = torch.zeros(batch, dtype=torch.long, device=device)
        self.first_B: list[int] = [0] * batch  # the cache column of each row's first token

    def prefill(
        self,
        ids_BL: torch.Tensor,
        mask_BL: torch.Tensor,
        prefixes: Sequence[KeyValues | None] | None = None,
    ) -> torch.Tensor:
        B, L = ids_BL.shape
        valid = mask_BL.bool()
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        self.key_bias_BT[:, :L] = torch.where(valid, 0.0, float("-inf"))
        lengths = valid.sum(-1).tolist()
        self.first_B = [L - n for n in lengths]
        todo = list(lengths)  # tokens each row runs: all but a cached prefix
        for r, prefix in enumerate(prefixes or []):
            if prefix is not None:
                first, n = self.first_B[r], prefix.length
                self.k[:, r, :, first : first + n] = prefix.keys
                self.v[:, r, :, first : first + n] = prefix.values
                todo[r] -= n
        logits: torch.Tensor | None = None
        # Rows of similar length run together, each group cut to its longest run of new tokens:
        # a batch mixing first turns with long later turns would otherwise spend most of its
        # prefill on padding. Prompts are left-padded, so a group's new tokens are the last
        # `width` columns, and its rows' keys the last `span` (a row's cached tokens before
        # `width` are in the cache already; those inside it are run again, to the same values).
        for rows, width in prefill_groups(todo, group_overhead(ids_BL.device)):
            span = max(lengths[r] for r in rows)
            index = torch.tensor(rows, device=ids_BL.device)
            ids, ok = ids_BL[index, L - width :], valid[index, L - span :]
            square = torch.ones(width, span, dtype=torch.bool, device=ok.device)
            causal = square.tril(span - width)  # query i is the key column span - width + i
            # Pad queries may see themselves, so no row is fully masked (that would give NaNs).
            itself = causal & ~square.tril(span - width - 1)
            allowed = causal & (ok[:, None, :] | itself)
            bias = torch.zeros(len(rows), 1, width, span, dtype=self.k.dtype, device=ok.device)
            bias = bias.masked_fill(~allowed[:, None], -torch.inf)
            hidden = self._forward(
                ids, pos_BL[index, L - width :], L - width, bias, index, keys_from=L - span
            )
            out = self.lm_head(self.norm(hidden[:, -1]))
            if logits is None:
                logits = out.new_empty(B, out.shape[-1])
            logits[index] = out
        self.length = L
        self.next_pos_B = pos_BL[:, -1] + 1
        assert logits is not None
        return logits

    def keep(self, rows: torch.Tensor) -> bool:
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]
        self.key_bias_BT = self.key_bias_BT[rows]
        self.next_pos_B = self.next_pos_B[rows]
        self.first_B = [self.first_B[r] for r in rows.tolist()]
        return True

    def saved(self, row: int) -> KeyValues:
        first = self.first_B[row]
        keys = self.k[:, row, :, first : self.length].clone()
        return KeyValues(keys, self.v[:, row, :, first : self.length].clone())

    def step(self, ids_B: torch.Tensor) -> torch.Tensor:
        t = self.length
        bias = self.key_bias_BT[:, None, None, : t + 1]
        hidden = self._forward(ids_B[:, None], self.next_pos_B[:, None], t, bias)
        self.length = t + 1
        self.next_pos_B = self.next_pos_B + 1
        return self.lm_head(self.norm(hidden[:, -1]))  # type: ignore[no-any-return]

    def _forward(
        self,
        ids_BS: torch.Tensor,
        pos_BS: torch.Tensor,
        start: int,
        bias: torch.Tensor,
        rows: torch.Tensor | None = None,
        keys_from: int | None = None,
    ) -> torch.Tensor:
        """Run tokens at cache positions `start:start+S`: a prefill group's `rows` (attending to
        their cache from `keys_from`, by default only to these tokens), or a step."""
        B, S = ids_BS.shape
        end = start + S
        cos, sin = self.cos[pos_BS][:, None], self.sin[pos_BS][:, None]  # [B, 1, S, D]
        x = self.embed(ids_BS)
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, f in enumerate(self.fused):
            h = _rms_norm(x, f.norm1, self.eps)
            qkv = F.linear(h, f.qkv_weight, f.qkv_bias)
            q = qkv[..., :q_width].view(B, S, self.heads, self.head_dim).transpose(1, 2)
            k = qkv[..., q_width : q_width + kv_width]
            k = k.view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
            v = qkv[..., q_width + kv_width :].view(B, S, self.kv_heads, self.head_dim)
            v = v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if rows is None:  # one new token per row: attend over the whole cache
                self.k[i, :, :, start:end] = k
                self.v[i, :, :, start:end] = v
                keys, values = self.k[i, :, :, :end], self.v[i, :, :, :end]
                out = self._decode_attention(q, keys, values, bias)
            else:  # a prefill group: its rows' cache before `keys_from` is padding
                self.k[i, rows, :, start:end] = k
                self.v[i, rows, :, start:end] = v
                if keys_from is not None and keys_from < start:
                    k = self.k[i, rows, :, keys_from:end]
                    v = self.v[i, rows, :, keys_from:end]
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, enable_gqa=self.heads != self.kv_heads
                )
            x = x + F.linear(out.transpose(1, 2).reshape(B, S, -1), f.o_weight)
            h = _rms_norm(x, f.norm2, self.eps)
            gate, up = F.linear(h, f.gate_up_weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, f.down_weight)
        return x

    def _decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one new token per row, heads grouped onto their shared KV head."""
        B, T = q.shape[0], keys.shape[2]
        group = self.heads // self.kv_heads
        q_grouped = q.reshape(B, self.kv_heads, group, self.head_dim)
        scores = torch.matmul(q_grouped, keys.transpose(-1, -2)) * self.head_dim**-0.5
        weights = torch.softmax(scores + bias.reshape(B, 1, 1, T), dim=-1)
        return torch.matmul(weights, values).reshape(B, self.heads, 1, self.head_dim)


# What one more prefill group costs beyond its tokens, in padded positions: the launch overhead
# of its ~20 small kernels per layer at the built-in sizes on CPU (measured, docs/benchmarks.md).
GROUP_OVERHEAD = 128
# On a GPU a group costs its launches whatever its width: a 0.5B model prefilled 64 prompts of
# 14-83 tokens (5,312 positions) in 24 ms as one group and 49 ms in 3 (H200, docs/benchmarks.md).
GPU_GROUP_OVERHEAD = 8192


def group_overhead(device: torch.device) -> int:
    """`prefill_groups`' cost of one more group on `device`."""
    return GPU_GROUP_OVERHEAD if device.type == "cuda" else GROUP_OVERHEAD


def prefill_groups(lengths: list[int], overhead: int | None = None) -> list[tuple[list[int], int]]:
    """Split a batch's rows into groups of similar prompt length: `(rows, width)` each.

    Minimises the padded positions a prefill runs (each group padded to its longest row) plus
    `overhead` per group (default `GROUP_OVERHEAD`, the CPU's), over groups of consecutive rows
    in length order; cuts fall only where the length changes, so the search is over distinct
    lengths.
    """
    overhead = GROUP_OVERHEAD if overhead is None else overhead
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    ls = [lengths[r] for r in order]
    starts = [i for i in range(len(ls)) if i == 0 or ls[i] != ls[i - 1]]
    # best[k]: the cheapest split of the rows of the k longest distinct lengths; cut[k]: where
    # its last group starts (an index into `starts`).
    ends = [*starts[1:], len(ls)]
    best = [0.0] + [float("inf")] * len(starts)
    cut = [0] * (len(starts) + 1)
    for k in range(1, len(starts) + 1):
        for j in range(k):
            cost = best[j] + (ends[k - 1] - starts[j]) * ls[starts[j]] + overhead
            if cost < best[k]:
                best[k], cut[k] = cost, j
    groups: list[tuple[list[int], int]] = []
    k = len(starts)
    while k > 0:
        j = cut[k]
        groups.append((order[starts[j] : ends[k - 1]], ls[starts[j]]))
        k = j
    return groups[::-1]


@dataclass
class _FusedLayer:
    """One decoder layer's weights, with q/k/v and gate/up concatenated: fewer, larger matmuls."""

    norm1: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    norm2: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


def _fuse(layer: Any) -> _FusedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    biases = [
        p.bias if p.bias is not None else torch.zeros(p.out_features, device=p.weight.device)
        for p in projections
    ]
    has_bias = any(p.bias is not None for p in projections)
    return _FusedLayer(
        norm1=layer.input_layernorm.weight,
        qkv_weight=torch.cat([p.weight for p in projections]),
        qkv_bias=torch.cat(biases) if has_bias else None,
        o_weight=attn.o_proj.weight,
        norm2=layer.post_attention_layernorm.weight,
        gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down_weight=mlp.down_proj.weight,
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    if dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HFStepper:
    """Any Hugging Face causal LM through its own forward and a `DynamicCache`."""

    reuses_prefixes = False

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache()
        self.mask_BT: torch.Tensor | None = None
        self.next_pos_B: torch.Tensor | None = None

    def prefill(
        self,
        ids_BL: torch.Tensor,
        mask_BL: torch.Tensor,
        prefixes: Sequence[KeyValues | None] | None = None,
    ) -> torch.Tensor:
        if prefixes is not None and any(p is not None for p in prefixes):
            raise ValueError("HFStepper runs every prompt token: it takes no cached prefixes")
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids_BL,
            attention_mask=mask_BL,
            position_ids=pos_BL,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.mask_BT = mask_BL
        self.next_pos_B = pos_BL[:, -1] + 1
        return out.logits[:, -1].float()  # type: ignore[no-any-return]

    def keep(self, rows: torch.Tensor) -> bool:
        return False

    def saved(self, row: int) -> KeyValues | None:
        return None

    def step(self, ids_B: torch.Tensor) -> torch.Tensor:
        assert self.mask_BT is not None and self.next_pos_B is not None
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones(len(ids_B), 1)], dim=1)
        out = self.model(
            input_ids=ids_B[:, None],
            attention_mask=self.mask_BT,
            position_ids=self.next_pos_B[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.next_pos_B = self.next_pos_B + 1
        return out.logits[:, -1].float()  # type: ignore[no-any-return]
