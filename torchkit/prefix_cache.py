"""Keys and values of sequences the sampler ran, for prompts that extend them.

An agent's next turn sends its whole conversation again: the last prompt, the model's reply, a
tool's result. Prefilling all of it again makes every turn cost the conversation so far. The
sampler keeps each finished request's keys and values here and the next prompt that starts with
its tokens prefills only what is new. Entries belong to one set of weights (`generation`): keys
and values computed by other weights would give other logprobs, so a new generation empties the
cache. Least recently used entries go first once `max_bytes` is reached. Batches running at once
share it (it locks); one still running on older weights neither reads nor clears it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["KeyValues", "PrefixCache"]

_MODULUS = (1 << 61) - 1
_BASE = 1_000_003


@dataclass(frozen=True)
class KeyValues:
    """Keys and values of a sequence's first `length` tokens: [layers, kv_heads, length, dim]."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    def first(self, n: int) -> KeyValues:
        return self if n == self.length else KeyValues(self.keys[:, :, :n], self.values[:, :, :n])


@dataclass
class _Entry:
    tokens: list[int]
    kv: KeyValues
    keys: list[tuple[int, int]]  # (length, prefix hash) under which the entry is found
    nbytes: int


def _prefix_hashes(tokens: list[int]) -> list[int]:
    """`h[n]`: a hash of `tokens[:n]`, for every n, in one pass."""
    hashes = [0]
    h = 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MODULUS
        hashes.append(h)
    return hashes


class PrefixCache:
    """Finished sequences' keys and values, found by the longest stored prefix of a prompt.

    Thread-safe: the sampler's batches running at once share it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.generation = -1
        self.nbytes = 0
        self.lookups = 0
        self.hits = 0
        self.reused_tokens = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[tuple[int, int], int] = {}
        self._lengths: dict[int, int] = {}  # stored key length -> how many keys have it
        self._next_id = 0
        self._lock = threading.Lock()

    def get(self, tokens: list[int], generation: int) -> KeyValues | None:
        """The keys and values of the longest stored prefix of `tokens` shorter than `tokens`
        (the last token is always run: its logits are the next token's), or None."""
        hashes = _prefix_hashes(tokens)
        with self._lock:
            self.lookups += 1
            if not self._use(generation) or not self._entries:
                return None
            for n in sorted((n for n in self._lengths if n < len(tokens)), reverse=True):
                entry_id = self._index.get((n, hashes[n]))
                if entry_id is None:
                    continue
                entry = self._entries[entry_id]
                if entry.tokens[:n] != tokens[:n]:  # a hash collision
                    continue
                self._entries.move_to_end(entry_id)
                self.hits += 1
                self.reused_tokens += n
                return entry.kv.first(n)
            return None

    def put(self, tokens: list[int], kv: KeyValues, generation: int, also: int = 0) -> None:
        """Store `kv`, the keys and values of `tokens`; found by prompts extending `tokens`, and
        with `also` > 0 by prompts extending `tokens[:also]` too (a prompt whose reply will come
        back re-encoded, perhaps into other tokens)."""
        if kv.length != len(tokens) or not tokens:
            raise ValueError(f"{kv.length} keys and values for {len(tokens)} tokens")
        nbytes = kv.keys.nbytes + kv.values.nbytes
        if nbytes > self.max_bytes:
            return
        hashes = _prefix_hashes(tokens)
        lengths = {len(tokens), *([also] if 0 < also < len(tokens) else [])}
        keys = [(n, hashes[n]) for n in sorted(lengths)]
        with self._lock:
            if not self._use(generation):
                return
            entry_id = self._next_id
            self._next_id += 1
            for key in keys:
                if key in self._index:
                    self._drop(self._index[key])
            self._entries[entry_id] = _Entry(list(tokens), kv, keys, nbytes)
            for key in keys:
                self._index[key] = entry_id
                self._lengths[key[0]] = self._lengths.get(key[0], 0) + 1
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def __len__(self) -> int:
        return len(self._entries)

    def _use(self, generation: int) -> bool:
        """Whether entries of `generation` may be read and stored: newer weights empty the cache;
        older ones (a batch still running on them) leave it as it is."""
        if generation < self.generation:
            return False
        if generation > self.generation:
            self._entries.clear()
            self._index.clear()
            self._lengths.clear()
            self.nbytes = 0
            self.generation = generation
        return True

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        for key in entry.keys:
            if self._index.get(key) == entry_id:
                del self._index[key]
                self._lengths[key[0]] -= 1
                if not self._lengths[key[0]]:
                    del self._lengths[key[0]]
        self.nbytes -= entry.nbytes
