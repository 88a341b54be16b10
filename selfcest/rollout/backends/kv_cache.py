"""A KV cache that writes each decode step into room reserved ahead, instead of copying.

transformers' `DynamicLayer` appends a step's keys and values by concatenating them to all
that is cached, so every decode step copies the whole cache in every layer, and the copying
grows with the context. A `ReservedLayer` allocates its buffers ahead (the HF backend: for
its prompts and up to `hf.RESERVED_AHEAD` new positions, doubled whenever outgrown),
writes new positions in place and hands attention views of the filled positions: the same
values in the same order along the sequence, so the model computes bitwise what it
computes with `DynamicLayer` (tests/rollout/backends/test_kv_cache.py). A decode of 32 rows takes
0.87-0.91x the time at contexts of 352-544 tokens, 0.99x at 90
(`benchmarks/decode_cache.py`, docs/performance.md).

Simplification: the buffers' batch dimension is reindexed by copying (rows that finish leave
the batch), and offloading to another device is not supported; the HF backend needs neither
more.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers of ``capacity`` positions
    (more are reserved, by doubling, if a decode outgrows them); ``keys`` and ``values`` are
    views of the filled positions."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0  # filled positions
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.key_buffer = _buffer_like(key_states, self.capacity)
            self.value_buffer = _buffer_like(value_states, self.capacity)
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[1]:
            self._rebuild(lambda buffer: buffer[:, :self.length],
                          max(end, 2 * self.key_buffer.shape[1]))
        self.key_buffer[:, self.length:end] = key_states.transpose(1, 2)
        self.value_buffer[:, self.length:end] = value_states.transpose(1, 2)
        self._fill(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            # Only the filled positions are copied: the rest is written before it is read.
            self._rebuild(lambda buffer: buffer[indices, :self.length], self.key_buffer.shape[1])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self._rebuild(lambda buffer: buffer[:, :self.length].repeat_interleave(repeats, dim=0),
                          self.key_buffer.shape[1])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # checks the argument, narrows the views
        if self.is_initialized:
            self.length = self.keys.shape[-2]

    def reset(self) -> None:
        super().reset()
        self.length = 0
        self.key_buffer = self.value_buffer = None

    def offload(self):
        raise NotImplementedError("ReservedLayer is not offloaded: use a DynamicCache with "
                                  "offloading=True")

    def _fill(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[:, :length].transpose(1, 2)
        self.values = self.value_buffer[:, :length].transpose(1, 2)

    def _rebuild(self, rows_of, capacity: int) -> None:
        """New buffers of ``capacity`` positions holding ``rows_of(buffer)``, the filled
        positions of the rows kept."""
        for name in ("key_buffer", "value_buffer"):
            kept = rows_of(getattr(self, name))
            new = kept.new_empty((kept.shape[0], capacity, *kept.shape[2:]))
            new[:, :self.length] = kept
            setattr(self, name, new)
        self._fill(self.length)


def reserved_cache(config, capacity: int, key_values=None) -> DynamicCache:
    """A `DynamicCache` for ``config``'s model whose layers are `ReservedLayer`s with room for
    ``capacity`` positions, holding ``key_values`` (per layer ``(keys, values)``) if given.
    Only for models whose cache is a stack of plain attention layers
    (`selfcest.modeling.plain_attention_cache`)."""
    cache = DynamicCache(config=config)
    cache.layers = [ReservedLayer(capacity) for _ in cache.layers]
    for layer, (keys, values) in zip(cache.layers, key_values or ()):
        layer.update(keys, values)
    return cache


def _buffer_like(states: torch.Tensor, capacity: int) -> torch.Tensor:
    """An empty buffer [batch, capacity, heads, dim] for ``states`` [batch, heads, positions,
    dim]. Positions before heads: attention reads the views of this layout as fast as
    contiguous keys, and views of [batch, heads, capacity, dim] up to 15% slower (sdpa on
    CPU, 32 rows, 30-90 positions)."""
    batch, heads, _, dim = states.shape
    return states.new_empty((batch, capacity, heads, dim))
