"""What the local server does with each call of the pinned tinker SDK: one table, three readers.

`METHODS` holds every public, non-deprecated method of the SDK's four clients (`ServiceClient`,
`TrainingClient`, `SamplingClient`, `RestClient`) as served, refused (with the one line the server
answers) or client only (no request reaches a server); `LOSS_NOTES` and
`training.REFUSED_LOSSES` do the same for each `loss_fn` the SDK names. The tests hold the table
to the SDK (`sdk_methods()`, `sdk_losses()`: a method or loss a new SDK adds fails until it is
classified) and to the server (each served call is driven through the real SDK in
`tests/test_tinker_fidelity.py`, each refused route answers its line); `docs/backends/tinker.md`
shows the table as `python -m tinker_server.compat` writes it, between the markers
`<!-- tinker-compat -->` and `<!-- end tinker-compat -->`, and `tests/test_docs.py` checks that
it is the generated one. Refusal reasons are read from the server's own tables (`rest.REFUSED`,
`training.REFUSED_LOSSES`), never written twice.
"""

from __future__ import annotations

import re
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tinker_server.rest import REFUSED
from tinker_server.training import LOSS_INPUTS, REFUSED_LOSSES

__all__ = [
    "CLIENTS",
    "LOSS_NOTES",
    "METHODS",
    "Support",
    "compatibility_markdown",
    "fill_compat_table",
    "main",
    "sdk_losses",
    "sdk_methods",
]

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")


@dataclass(frozen=True)
class Support:
    """How the local server answers one SDK method: `served`, `refused` or `client only`."""

    status: Literal["served", "refused", "client only"]
    note: str


def _served(note: str) -> Support:
    return Support("served", note)


def _refused(note: str) -> Support:
    return Support("refused", note)


def _client(note: str) -> Support:
    return Support("client only", note)


def _route(method: str, path: str) -> Support:
    return Support("refused", REFUSED[(method, path)])


_RUNS = "a run per training model (created or restored): base model, LoRA rank, `user_metadata`"
_CHECKPOINTS = "every checkpoint in the store, newest first: size, `user_metadata`, `expires_at`"

METHODS: dict[str, Support] = {
    "ServiceClient.close": _served("ends the session; frees its training models and samplers"),
    "ServiceClient.copy_weights": _route("POST", "/api/v1/copy_weights"),
    "ServiceClient.create_custom_loss": _route("POST", "/api/v1/create_custom_loss"),
    "ServiceClient.create_lora_training_client": _served(
        "LoRA of the requested rank on attention, MLP and unembedding (`train_*`), alpha 32"
    ),
    "ServiceClient.create_sampling_client": _served(
        "from a `tinker://` sampler or training checkpoint, or the base model"
    ),
    "ServiceClient.create_training_client_from_state": _served("weights only"),
    "ServiceClient.create_training_client_from_state_with_optimizer": _served(
        "weights and AdamW state"
    ),
    "ServiceClient.get_console_url": _client("a URL of the hosted service's console"),
    "ServiceClient.get_telemetry": _client("the SDK's telemetry (off: `TINKER_TELEMETRY=0`)"),
    "ServiceClient.holder": _client("the SDK's connection holder"),
    "TrainingClient.create_sampling_client": _served("as `ServiceClient.create_sampling_client`"),
    "TrainingClient.forward": _served("logprobs and the loss, no gradient"),
    "TrainingClient.forward_backward": _served("the `loss_fn` values below"),
    "TrainingClient.forward_backward_custom": _served(
        "a `forward`, then a weighted `cross_entropy` backward (the loss runs on the client)"
    ),
    "TrainingClient.get_console_url": _client("a URL of the hosted service's console"),
    "TrainingClient.get_info": _served("the canonical model name; the tokenizer directory"),
    "TrainingClient.get_telemetry": _client("the SDK's telemetry"),
    "TrainingClient.get_tokenizer": _served("loads from the local directory `get_info` names"),
    "TrainingClient.optim_step": _served("AdamW with the request's hyperparameters"),
    "TrainingClient.save_state": _served(
        "`tinker://<run>/weights/<name>`: adapters and optimizer state; `ttl_seconds`, "
        "`user_metadata`"
    ),
    "TrainingClient.save_weights_and_get_sampling_client": _served(
        'a snapshot (`kind="inflight"` is served as a snapshot)'
    ),
    "TrainingClient.save_weights_external": _served(
        "a Hugging Face model directory (adapters merged, tokenizer included) that `model: DIR` "
        "loads; with `age_encryption_recipients`, each file encrypted to them (`.age`)"
    ),
    "TrainingClient.save_weights_for_sampler": _served(
        "`tinker://<run>/sampler_weights/<name>`; `ttl_seconds`, `user_metadata`"
    ),
    "SamplingClient.compute_logprobs": _served("batched with other prompt-logprob requests"),
    "SamplingClient.create": _served("what `create_sampling_client` calls"),
    "SamplingClient.from_sampler_handle": _client("rebuilds a client from a handle"),
    "SamplingClient.get_base_model": _served("the canonical model name"),
    "SamplingClient.get_sampler_handle": _client("a picklable handle"),
    "SamplingClient.get_telemetry": _client("the SDK's telemetry"),
    "SamplingClient.get_tokenizer": _client(
        "loads from the base model's name: use a directory name (Model names)"
    ),
    "SamplingClient.on_queue_state_change": _client("the local queue is always active"),
    "SamplingClient.sample": _served(
        "`temperature`, `top_p`, `stop`, `seed`, prompt logprobs, `topk_prompt_logprobs` "
        "(at most 20 with `--engine vllm`); "
        "`top_k`, `topk_sample_logprobs`, `target_prompt_logprobs`, `prompt_alt_tokens_k` refused"
    ),
    "RestClient.assign_session_project": _route("PUT", "/api/v1/sessions/{session_id}/project"),
    "RestClient.copy_weights": _route("POST", "/api/v1/copy_weights"),
    "RestClient.delete_checkpoint": _served("the cookbook's rolling checkpoints"),
    "RestClient.delete_checkpoint_from_tinker_path": _served("as `delete_checkpoint`"),
    "RestClient.export_session_trace": _route("GET", "/api/v1/sessions/{session_id}/trace_export"),
    "RestClient.get_external_weights_urls": _served(
        "signed URLs, valid for an hour, that need no API key"
    ),
    "RestClient.get_sampler": _served("the base model (`model_path` is not kept)"),
    "RestClient.get_server_capabilities": _served(
        "the canonical name and, for a built-in model, its tokenizer directory"
    ),
    "RestClient.get_session": _route("GET", "/api/v1/sessions/{session_id}"),
    "RestClient.get_telemetry": _client("the SDK's telemetry"),
    "RestClient.get_training_run": _served(_RUNS),
    "RestClient.get_training_run_by_tinker_path": _served(_RUNS),
    "RestClient.get_weights_info_by_tinker_path": _served(
        "base model, LoRA rank and trained layers"
    ),
    "RestClient.list_checkpoints": _served(_CHECKPOINTS),
    "RestClient.list_sessions": _route("GET", "/api/v1/sessions"),
    "RestClient.list_training_runs": _served(_RUNS + "; owner `local`"),
    "RestClient.list_user_checkpoints": _served(_CHECKPOINTS),
    "RestClient.publish_checkpoint_from_tinker_path": _served(
        "as a flag: every client of the server reads every checkpoint anyway"
    ),
    "RestClient.set_checkpoint_ttl_from_tinker_path": _served(
        "an expired checkpoint is deleted the next time the store is read"
    ),
    "RestClient.unpublish_checkpoint_from_tinker_path": _served("as a flag"),
    "RestClient.whoami": _refused(
        "by the SDK itself: it needs JWT auth, which the local server leaves off "
        "(any `tml-` key works)"
    ),
}
"""Every public, non-deprecated method of the pinned SDK's clients, and what the server does."""

LOSS_NOTES: dict[str, str] = {
    "cross_entropy": "`-sum(w * logp)`; soft targets, `(N, K)` `target_tokens` and `weights`: "
    "`-sum(w[n, k] * logp(target[n, k]))`, `logprobs` `(N, K)`",
    "importance_sampling": "`-sum(exp(logp - q) * A)`",
    "ppo": "clip thresholds (default 0.8 / 1.2) symmetric around 1",
    "cispo": "clip thresholds (default 0.8 / 1.2) symmetric around 1",
    "dro": "`-sum(logp * A - beta / 2 * (logp - q)^2)`; `beta` required",
    "gspo": "GSPO-token: one clipped ratio per datum over `sequence_ratio_mask`",
}
"""What the server's own implementation of each served `loss_fn` notes (torchkit/losses.py)."""


def sdk_methods() -> list[str]:
    """The public, non-deprecated methods (and properties) of the installed SDK's clients."""
    import tinker

    found = []
    for client_name in CLIENTS:
        client = getattr(tinker, client_name)
        for name, member in vars(client).items():
            target = getattr(member, "fget", member)
            if name.startswith("_") or getattr(target, "__deprecated__", None):
                continue
            if callable(target):
                found.append(f"{client_name}.{name}")
    return sorted(found)


def sdk_losses() -> list[str]:
    """The `loss_fn` values the installed SDK names (`tinker.types.LossFnType`)."""
    from tinker.types import LossFnType

    return list(typing.get_args(LossFnType))


def compatibility_markdown() -> str:
    """The methods table and the `loss_fn` table, as `docs/backends/tinker.md` shows them."""
    served = sum(s.status == "served" for s in METHODS.values())
    refused = sum(s.status == "refused" for s in METHODS.values())
    lines = [
        f"{len(METHODS)} methods: {served} served, {refused} refused, "
        f"{len(METHODS) - served - refused} client only.",
        "",
        "| SDK method | local server | |",
        "|---|---|---|",
    ]
    lines += [f"| `{name}` | {s.status} | {s.note} |" for name, s in METHODS.items()]
    lines += ["", "| `loss_fn` | local server | |", "|---|---|---|"]
    for loss in sdk_losses():
        if loss in LOSS_INPUTS:
            lines.append(f"| `{loss}` | served | {LOSS_NOTES[loss]} |")
        else:
            lines.append(f"| `{loss}` | refused | {REFUSED_LOSSES[loss]} |")
    return "\n".join(lines) + "\n"


_MARKED = re.compile(
    r"(?P<begin><!-- tinker-compat -->\n).*?(?P<end><!-- end tinker-compat -->)", re.DOTALL
)


def fill_compat_table(text: str) -> str:
    """`text` with its marked compatibility table regenerated."""
    return _MARKED.sub(
        lambda m: f"{m['begin']}\n{compatibility_markdown()}\n{m['end']}", text, count=1
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the marked table of a doc (default `docs/backends/tinker.md`), or print it."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--print"]:
        print(compatibility_markdown(), end="")
        return 0
    path = Path(args[0] if args else "docs/backends/tinker.md")
    text = path.read_text()
    if not _MARKED.search(text):
        print(f"{path} has no <!-- tinker-compat --> marker", file=sys.stderr)
        return 1
    filled = fill_compat_table(text)
    if filled != text:
        path.write_text(filled)
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
