import threading
import time

import pytest
from reward_tree_builders import node, returned, said, single_turn, tree_of

from selfcest.rewards.base import final_turn_text
from selfcest.rewards.math import (
    MathScorer,
    MathVerifier,
    as_integer,
    math_answer,
    math_reward,
)
from selfcest.task import Task
from selfcest.tree import Spawn


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout_s=1.0)
    yield v
    v.close()


def score(verifier, text, answer):
    return MathScorer(verifier)(text, Task("t", "q", answer))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So the answer is \\boxed{12}.\nThat is all.", "12"),
        ("Answer: 7", "7"),
        ("Answer: $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("first \\boxed{3}\nAnswer: 4", "4"),  # the later of box and marker wins
        ("Answer: 4\nchecking: \\boxed{5}", "5"),
        ("answer:\n\n  9  \nmore", "9"),
        ("no marker\n\n42\n", "42"),
        ("", ""),
    ],
)
def test_math_answer(text, expected):
    assert math_answer(text) == expected


@pytest.mark.parametrize(
    "text, value",
    [("1,234", 1234), ("$-5$", -5), ("80.", 80), ("\\boxed{7}", 7), ("−3", -3),
     ("1,2", None), ("12.5", None), ("x = 12", None), ("", None), ("12,34", None)],
)
def test_as_integer(text, value):
    assert as_integer(text) == value


@pytest.mark.parametrize(
    "text, answer, correct",
    [
        ("Answer: 1,234", "1234", True),  # integers compare as integers, commas removed
        ("Answer: 1234", "1,234", True),
        ("Answer: 080", "80", True),
        ("\\boxed{12}", "12", True),
        ("Answer: 13", "12", False),
        ("Answer: 12.0", "12", True),  # not a plain integer: math-verify decides
        ("The value is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", True),
        ("Answer: 0.5", "\\frac{1}{2}", True),
        ("Answer: 3\\sqrt2", "3\\sqrt{2}", True),  # bare LaTeX is read as boxed
        ("Answer: \\sqrt{18}", "3\\sqrt{2}", True),
        ("Answer: (1, 2)", "(1,2)", True),
        ("Answer: [2, 5]", "[2,5)", False),
        ("Answer: C", "\\text{(C)}", True),
        ("Answer: 1,2", "12", False),
    ],
)
def test_correctness(verifier, text, answer, correct):
    assert score(verifier, text, answer).correct is correct


def test_empty_output_is_wrong_without_a_worker_call(verifier):
    result = score(verifier, "", "12")
    assert (result.score, result.correct,
            result.info) == (0.0, False, {"math/empty": 1.0, "answer_missing": 1.0})


@pytest.mark.parametrize(
    "text", ["Answer: 9^9^9^9", "\\boxed{10^{10^{10}}}", "Answer: 7^{10^{8}}", "\\boxed{(10^{7})!}"]
)
def test_astronomical_answers_are_screened_fast(verifier, text):
    score(verifier, "Answer: 1", "\\frac{1}{2}")  # the worker is up before timing
    start = time.monotonic()
    result = score(verifier, text, "12")
    assert time.monotonic() - start < 1.0  # a hang would never return
    assert result.info == {"math/too_large": 1.0, "answer_missing": 0.0} and not result.correct


def test_a_slow_comparison_is_cut_off_and_the_worker_restarts(verifier):
    score(verifier, "Answer: 1", "\\frac{1}{2}")
    restarts = verifier.restarts
    start = time.monotonic()
    # Passes the magnitude screen (each term is small) but sympy would sum 10^6 powers.
    result = score(verifier, "\\boxed{\\sum_{k=1}^{10^{6}} k^k}", "\\frac{1}{2}")
    assert time.monotonic() - start < verifier.timeout_s + 2.0
    assert result.info == {"math/timeout": 1.0, "answer_missing": 0.0} and not result.correct
    assert verifier.restarts == restarts + 1
    assert score(verifier, "Answer: 0.5", "\\frac{1}{2}").correct  # a fresh worker answers


def test_overlong_answers_are_not_parsed(verifier):
    result = score(verifier, "Answer: " + "1+" * 600 + "1", "\\frac{1}{2}")
    assert result.info == {"math/too_long": 1.0, "answer_missing": 0.0}


def test_works_off_the_main_thread(verifier):
    results = []
    worker = threading.Thread(target=lambda: results.append(score(verifier, "Answer: 1/2", "0.5")))
    worker.start()
    worker.join()
    assert results[0].correct


def test_answer_comes_from_the_final_turn_only(verifier):
    root = node(
        "0",
        [
            said("Answer: 12 <spawn>check<sep>check</spawn>"),
            returned("13<sep>13"),
            said("Answer: 13"),
        ],
        [Spawn(0, ["0.0"])],
    )
    tree = tree_of(root, node("0.0", [said("Answer: 13")]))
    assert final_turn_text(tree) == "Answer: 13"
    reward = math_reward()
    assert not reward(tree, Task("t", "q", "12")).correct
    assert reward(tree, Task("t", "q", "13")).correct


def test_reference_math_shaping():
    reward = math_reward()
    correct_long = reward(single_turn("Answer: 5<|im_end|>", tokens=768), Task("t", "q", "5"))
    assert correct_long.correct
    assert correct_long.score == pytest.approx(1 - 0.3 * (1 - 2.718281828459045**-1))
    wrong_long = reward(single_turn("Answer: 6", tokens=1024), Task("t", "q", "5"))
    assert wrong_long.score == 0.0 and not wrong_long.correct  # floored at 0
