"""ReservedLayer holds what transformers' DynamicLayer holds, after every cache operation,
and a decode through it is bitwise a decode through a DynamicCache."""

from __future__ import annotations

import pytest
import torch
from test_hf import generate_all, prompts, reference_decode
from transformers.cache_utils import DynamicLayer

from selfcest.rollout.backends import hf
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.kv_cache import ReservedLayer, reserved_cache


def states(batch: int, positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [batch, 2 heads, positions, 3 dims]."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 2, positions, 3, generator=generator),
            torch.randn(batch, 2, positions, 3, generator=generator))


def assert_same(reserved: ReservedLayer, dynamic: DynamicLayer) -> None:
    assert reserved.get_seq_length() == dynamic.get_seq_length()
    assert torch.equal(reserved.keys, dynamic.keys) and torch.equal(reserved.values, dynamic.values)


@pytest.mark.parametrize("capacity", [2, 7, 40])  # outgrown at once, outgrown later, never
def test_a_reserved_layer_holds_what_a_dynamic_layer_holds(capacity):
    reserved, dynamic = ReservedLayer(capacity), DynamicLayer()
    operations = [
        ("update", states(4, 5, 0)),  # a prefill
        ("update", states(4, 1, 1)),  # a decode step
        ("batch_select_indices", torch.tensor([3, 0, 0, 2])),  # rows leave, one is copied
        ("update", states(4, 1, 2)),
        ("batch_repeat_interleave", 2),
        ("update", states(8, 3, 3)),
        ("crop", -2),
        ("reorder_cache", torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])),
        ("update", states(8, 1, 4)),
    ]
    for name, argument in operations:
        for layer in (reserved, dynamic):
            if name == "update":
                returned = layer.update(*argument)
                assert returned[0] is layer.keys and returned[1] is layer.values
            else:
                getattr(layer, name)(argument)
        assert_same(reserved, dynamic)
    for layer in (reserved, dynamic):
        layer.reset()
        layer.update(*states(2, 3, 5))
    assert_same(reserved, dynamic)


def test_reserved_positions_are_written_in_place():
    layer = ReservedLayer(capacity=10)
    layer.update(*states(2, 4, 0))
    buffer = layer.key_buffer
    layer.update(*states(2, 1, 1))
    assert layer.key_buffer is buffer  # no copy while there is room
    assert layer.keys.data_ptr() == buffer.data_ptr()


def test_a_reserved_cache_starts_from_given_keys_and_values(tiny_policy):
    config = tiny_policy.model.config
    layers = config.num_hidden_layers
    given = [states(3, 4, layer) for layer in range(layers)]
    cache = reserved_cache(config, capacity=6, key_values=given)
    assert len(cache.layers) == layers and cache.get_seq_length() == 4
    for layer, (keys, values) in zip(cache.layers, given):
        assert isinstance(layer, ReservedLayer)
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@pytest.mark.parametrize("room", ["backend's", "two positions ahead", "outgrown every step"])
def test_decoding_through_reserved_buffers_is_bitwise_the_dynamic_cache_loop(
    tiny_policy, monkeypatch, room):
    if room == "two positions ahead":
        monkeypatch.setattr(hf, "RESERVED_AHEAD", 2)
    if room == "outgrown every step":
        monkeypatch.setattr(hf, "reserved_cache", lambda config, _, key_values=None:
                            reserved_cache(config, 1, key_values))
    sampling = SamplingParams(temperature=0.9)
    requests = [(p, dict(max_tokens=6 + 3 * i, stop_token_ids=[], sampling=sampling, seed=i))
                for i, p in enumerate(prompts(tiny_policy.tokenizer, 4))]
    backend = hf.HFBackend(tiny_policy.model, tiny_policy.tokenizer.pad_token_id)
    completions = generate_all(backend, requests)
    expected = reference_decode(tiny_policy.model, tiny_policy.tokenizer.pad_token_id, requests)
    assert [(c.token_ids, c.logprobs) for c in completions] == [tuple(e) for e in expected]
