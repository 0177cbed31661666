"""Training sequences -> Tinker `Datum`s (the layout only: the data is `unified.sequences`').

Shift by one: a sequence of tokens `s` becomes `model_input = s[:-1]`, `target_tokens = s[1:]`,
so input position i predicts token i+1, and every loss input has one entry per input position:
the sampler's `logprobs` and the `advantages` on sampled tokens, zeros on prompt (and tool
observation) tokens. Tinker's losses have no KL or entropy term: the backend folds both into the
advantages first (`unified.sequences.fold_kl_penalty`, `sequences_of(..., entropy_fold=...)`).
Only the keys the loss takes are sent (`target_tokens` + `weights` for cross_entropy).
"""

from __future__ import annotations

import numpy as np
import tinker

from unified.sequences import TrainingSequence

__all__ = ["to_datum"]


def to_datum(sequence: TrainingSequence, loss_fn: str, scale: float = 1.0) -> tinker.Datum:
    """The shifted-by-one `Datum` of a sequence; loss inputs are multiplied by `scale`."""
    tokens = sequence.tokens
    sampled = np.asarray(sequence.mask[1:], dtype=np.float32)
    inputs: dict[str, np.ndarray | list[int]] = {"target_tokens": tokens[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = sampled * scale
    else:
        advantages = np.asarray(sequence.advantages[1:], dtype=np.float32) * sampled
        inputs["advantages"] = advantages * scale
        inputs["logprobs"] = np.asarray(sequence.logprobs[1:], dtype=np.float32) * sampled
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs=inputs,  # type: ignore[arg-type]
    )
