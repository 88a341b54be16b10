"""Learning-rate multipliers: warmup, then constant or a decay down to the floor."""

import pytest

from selfcest.train.schedule import lr_lambda


def test_warmup_then_decay_to_the_floor():
    cosine = lr_lambda("cosine", warmup=4, total=14, floor=0.1)
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(9) == pytest.approx(0.55)  # half way: halfway between 1 and the floor
    assert cosine(14) == pytest.approx(0.1) and cosine(100) == pytest.approx(0.1)
    linear = lr_lambda("linear", warmup=0, total=10)
    assert [linear(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_lambda("constant", warmup=2, total=10)(7) == 1.0
