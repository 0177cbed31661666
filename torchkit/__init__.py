"""The torch kit: the PyTorch pieces every backend and the Tinker-compatible server share.

`sampler` (the batching sampler), `decoding` (incremental decoding over a KV cache),
`prefix_cache` (keys and values reused by prompts that extend them), `builtin` (built-in models,
loading and saving policies, the chat template), `losses` (per-token policy losses and their
aggregation), `snapshots` (sampler weights in checkpoints), `engine` (the rollout engine over a
batching sampler). It imports only `unified` and torch/transformers, never `backends` nor the
server, so a backend uses it without importing another backend. Importing this package loads
nothing: import the module you need.
"""
