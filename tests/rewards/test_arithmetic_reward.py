import math

import pytest
from reward_tree_builders import single_turn

from selfcest.rewards.arithmetic import (
    IntegerScorer,
    arithmetic_reward,
    closeness_credit,
    last_integer,
)
from selfcest.task import Task


@pytest.mark.parametrize(
    "text, value",
    [("Answer: 42", 42), ("3 + 4 = 7", 7), ("-12", -12), ("x = −5", -5), ("12-3", 3),
     ("1,234,567", 1234567), ("7.0", 7), ("7.5", None), ("no digits", None), ("", None),
     ("v2 then 10", 10)],
)
def test_last_integer(text, value):
    assert last_integer(text) == value


def test_closeness_credit_by_hand():
    assert closeness_credit(5, 5) == 1.0
    # |A-B| = 2, 2 + max = 14: 0.2 / log2(2 + 2/sqrt(14)) = 0.2 / log2(2.534522) = 0.149063
    assert closeness_credit(10, 12) == pytest.approx(0.149063, abs=1e-6)
    # The reference divides by zero at max(A, B) = -2; here 2 + |-2| = 4:
    # 0.2 / log2(2 + 3/2) = 0.2 / 1.807355 = 0.110659
    assert closeness_credit(-2, -5) == pytest.approx(0.110659, abs=1e-6)
    # Far apart: x = 10^6 / sqrt(10^6 + 2) = 1000 (to 1e-6): 0.2 / log2(1002) = 0.020063
    assert closeness_credit(0, 10**6) == pytest.approx(0.020063, abs=1e-6)
    # 5000-digit answers (no float overflow): x = 10^5000 / 10^2500, log2 x = 2500 log2(10)
    assert closeness_credit(10**5000, 3) == pytest.approx(0.2 / 8304.820237, rel=1e-6)


def test_exact_match_and_partial_credit():
    task = Task("t", "q", "1234")
    assert IntegerScorer()("Answer: 1,234", task).correct
    wrong = IntegerScorer()("Answer: 1230", task)
    assert (wrong.score, wrong.correct) == (0.0, False)
    partial = IntegerScorer(partial_credit=True)("Answer: 1230", task)
    assert 0 < partial.score < 0.2 and not partial.correct
    missing = IntegerScorer(partial_credit=True)("I give up", task)
    assert (missing.score, missing.info) == (0.0, {"answer_missing": 1.0})
    with pytest.raises(ValueError, match="no integer"):
        IntegerScorer()("Answer: 1", Task("t", "q", "Paris"))


def test_reference_arithmetic_shaping_has_no_floor():
    reward = arithmetic_reward()  # default CostConfig: root 512/256/0.3, calls, no floor
    result = reward(single_turn("Answer: 3", tokens=1024), Task("t", "q", "4"))
    assert result.score == pytest.approx(-0.3 * (1 - math.exp(-2)))
    assert result.info["task_score"] == 0.0
