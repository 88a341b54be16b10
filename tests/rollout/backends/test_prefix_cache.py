"""PrefixCache: longest stored prefix, used once, bounded memory, dropped when weights change."""

from __future__ import annotations

import torch

from selfcest.rollout.backends.prefix_cache import PrefixCache


def key_values(length: int, layers: int = 2, mark: float = 0.0):
    """Per layer keys and values [1, 2 heads, length, 4 dims]; position p holds mark + p."""
    column = (mark + torch.arange(length,
                                  dtype=torch.float32))[None, None, :, None].expand(1, 2, length, 4)
    return [(column.clone(), -column.clone()) for _ in range(layers)]


def test_the_longest_stored_prefix_is_taken_once():
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2], key_values(2, mark=100))
    cache.put([1, 2, 3, 4], key_values(4, mark=200))
    cache.put([9, 9, 9], key_values(3, mark=300))
    hit = cache.take([1, 2, 3, 4, 5, 6])
    assert hit.length == 4 and hit.key_values[0][0][0, 0, :, 0].tolist() == [200, 201, 202, 203]
    assert cache.take([1, 2, 3, 4, 5, 6]).length == 2  # used once: the shorter one is next
    assert cache.take([1, 2, 3, 4, 5, 6]) is None
    assert cache.take([9, 9]) is None  # a stored sequence longer than the prompt is no prefix of it
    assert len(cache) == 1


def test_rows_that_stored_the_same_tokens_share_one_entry_used_once_by_each():
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([3, 4], key_values(2, mark=10))
    cache.put([3, 4], key_values(2, mark=20))
    assert len(cache) == 1
    assert [cache.take([3, 4, 5]).key_values[0][0][0, 0, 0, 0].item() for _ in range(2)] == [10, 10]
    assert cache.take([3, 4, 5]) is None


def test_a_prompt_equal_to_a_stored_sequence_leaves_its_last_token_to_prefill():
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([5, 6, 7], key_values(3))
    hit = cache.take([5, 6, 7])
    assert hit.length == 2 and hit.key_values[1][1].shape == (1, 2, 2, 4)


def test_memory_is_bounded_by_evicting_the_oldest():
    size = sum(k.nbytes + v.nbytes for k, v in key_values(10))
    cache = PrefixCache(max_bytes=2 * size)
    for first in range(3):
        cache.put([first] * 10, key_values(10))
    assert len(cache) == 2 and cache.take([0] * 10) is None and cache.take([2] * 11).length == 10
    cache.put([7] * 30, key_values(30))  # larger than the whole bound: not kept, nothing evicted
    assert len(cache) == 1 and cache.take([7] * 31) is None


def test_entries_are_dropped_when_the_weights_are_written():
    model = torch.nn.Linear(3, 3)
    cache = PrefixCache(max_bytes=1 << 20)
    cache.check_weights(model)
    cache.put([1, 2], key_values(2))
    cache.check_weights(model)  # nothing written: the entry stays
    assert len(cache) == 1
    with torch.no_grad():
        model.weight.add_(1.0)  # what an optimizer step does
    cache.check_weights(model)
    assert len(cache) == 0
