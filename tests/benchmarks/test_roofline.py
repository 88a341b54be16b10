"""benchmarks/roofline.py: the work it counts is the work of a decode and of an update."""

from __future__ import annotations

import sys

from helpers import load_module


def test_counted_work_is_a_forward_per_decoded_position_and_three_per_trained_one(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on the path
    roofline = load_module("benchmarks/roofline.py", "roofline")
    rows = {row["phase"]: row for row in roofline.measure("small", repeats=1)}
    model = roofline.random_qwen2("small", vocab_size=16)
    # Matmul weights of the decoder layers: 2 FLOPs per weight and position forward, 4 more
    # backward (gradients of the input and of the weight); attention and the output layer
    # add less than half of that at these lengths.
    weights = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name
                  and p.dim() == 2)
    decode_floor = 2 * weights * rows["decode"]["tokens"]
    update_floor = 6 * weights * rows["update"]["tokens"]
    assert decode_floor <= rows["decode"]["gflop"] * 1e9 <= 1.5 * decode_floor
    assert update_floor <= rows["update"]["gflop"] * 1e9 <= 1.5 * update_floor
    for row in rows.values():
        assert 0 < row["floor_seconds"] and 0 < row["rate"] and 0 < row["ceiling"]
