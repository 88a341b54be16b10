"""PrefixCache: the KV cache of sequences that stopped, kept for the request that resumes them.

A node that stops on a spawn call resumes later with its whole context as the prompt: its
own prompt and turn, then the clones' answers. Without a cache that context is prefilled
again; in a clone tree those re-prefills are about two fifths of all prefill work. The HF
backend stores here the keys and values of every row that stops on one of its request's
resume tokens (the spawn-close token), and a later request whose prompt starts with a
stored sequence takes that entry and prefills only the rest.

An entry is used once per row that stored it (a node resumes once; rows with the same
tokens, such as the roots of one task sampled greedily, share one entry) and is dropped when
the weights change, since its keys and values were computed by the old ones. Entries beyond
the memory bound are evicted oldest first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# per layer: keys, values [1, heads, length, dim]
KeyValues = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class CachedPrefix:
    """The keys and values of ``length`` leading tokens of a request's prompt."""

    length: int
    key_values: KeyValues


@dataclass
class _Entry:
    key_values: KeyValues
    uses: int  # rows that stored these tokens and have not resumed yet


class PrefixCache:
    """Stored sequences and their per-layer keys and values, bounded by ``max_bytes``.

    Simplifications: lookup is a scan over the entries (a tree keeps at most a few dozen
    waiting nodes); only models whose cache is a stack of plain full-attention layers are
    supported (`HFBackend` checks, and turns the cache off for others).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, ...], _Entry] = {}  # insertion order = age
        self._bytes = 0
        self._weights: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, token_ids: Sequence[int], key_values: KeyValues) -> None:
        """Keep ``key_values`` (one position per token of ``token_ids``) for a later prompt."""
        key = tuple(token_ids)
        if key in self._entries:  # the same tokens: their keys and values up to float noise
            self._entries[key].uses += 1
            return
        size = _size(key_values)
        if size > self.max_bytes:
            return
        self._entries[key] = _Entry(key_values, uses=1)
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def take(self, prompt_ids: Sequence[int]) -> CachedPrefix | None:
        """Use once the longest stored sequence that ``prompt_ids`` starts with, shortened to
        leave at least the prompt's last token to prefill (its logits are the first token's
        distribution); None if none is stored."""
        prompt = tuple(prompt_ids)
        best = max((key for key in self._entries if prompt[: len(key)] == key), key=len,
                   default=None)
        if best is None:
            return None
        entry = self._entries[best]
        entry.uses -= 1
        if not entry.uses:
            self._drop(best)
        length = min(len(best), len(prompt) - 1)
        return CachedPrefix(length,
                            [(k[:, :, :length], v[:, :, :length]) for k, v in entry.key_values])

    def check_weights(self, model) -> None:
        """Drop every entry if ``model``'s parameters were written since the last check (an
        optimizer step or a weight load bumps each parameter tensor's version counter)."""
        weights = tuple(param._version for param in model.parameters())
        if weights != self._weights:
            self.clear()
            self._weights = weights

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        self._bytes -= _size(self._entries.pop(key).key_values)


def _size(key_values: KeyValues) -> int:
    return sum(keys.nbytes + values.nbytes for keys, values in key_values)
