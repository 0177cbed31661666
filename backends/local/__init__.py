"""The local backend: in-process PyTorch policies, built-in or from a local model directory.

`backend.py` is `LocalBackend`; the torch pieces it trains and samples with (sampler, decoding,
prefix cache, built-in models, losses) live in the torch kit, `torchkit/`, which the other
backends and the Tinker-compatible server share. Importing this package loads nothing.
"""
