"""benchmarks/decode_cache.py: both ways decode the same tokens, and each way is what it says."""

from __future__ import annotations

import sys

from helpers import load_module

from selfcest.rollout.backends import kv_cache


def test_both_caches_draw_the_same_tokens_and_the_reserved_way_writes_in_place(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on the path
    benchmark = load_module("benchmarks/decode_cache.py", "decode_cache")
    updates = []
    original = kv_cache.ReservedLayer.update
    monkeypatch.setattr(kv_cache.ReservedLayer, "update",
                        lambda self, *a, **k: updates.append(1) or original(self, *a, **k))
    result = benchmark.compare("large", prompt_tokens=6, new_tokens=3, rows=8, pairs=2)
    assert result["identical"] and result["reserved"] > 0 and result["dynamic"] > 0
    # Reserved layers served exactly the reserved decodes: 2 of them, 3 passes, 10 layers.
    assert len(updates) == 2 * 3 * 10
