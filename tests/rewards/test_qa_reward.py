import pytest
from reward_tree_builders import single_turn

from selfcest.rewards.qa import (
    QAScorer,
    exact_match,
    normalize_answer,
    qa_reward,
    token_f1,
)
from selfcest.task import Task


def task(answer, aliases=None):
    return Task("t", "q", answer, metadata={} if aliases is None else {"aliases": aliases})


@pytest.mark.parametrize(
    "raw, normalised",
    [("The Eiffel Tower.", "eiffel tower"), ("  An  apple,  a DAY ", "apple day"),
     ("Théâtre-du-Soleil!", "théâtredusoleil"), ("there", "there"), ("", "")],
)
def test_normalize(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_exact_match_ignores_case_punctuation_and_articles():
    assert exact_match("Paris.", "paris") == 1.0
    assert exact_match("the  Beatles", "Beatles") == 1.0
    assert exact_match("Paris, France", "Paris") == 0.0


def test_token_f1_by_hand():
    # prediction 3 tokens, reference 2, 2 in common: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("New York City", "new york") == pytest.approx(0.8)
    # repeated tokens count once per occurrence: P = 1/3, R = 1/1 -> 0.5
    assert token_f1("paris paris paris", "Paris") == pytest.approx(0.5)
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("the", "a") == 1.0  # both normalise to nothing


def test_aliases_count():
    scorer = QAScorer()
    assert scorer("Answer: nineteen sixty", task("1960", ["in 1960", "nineteen sixty"])).correct
    assert not scorer("Answer: 1961", task("1960", ["in 1960"])).correct
    assert scorer("Answer: USA", task("United States", "USA")).correct  # a single alias string
    with pytest.raises(ValueError, match="aliases"):
        scorer("Answer: x", task("y", [1, 2]))


def test_f1_metric_scores_partially_but_correct_stays_exact():
    result = QAScorer("f1")("Thinking...\nAnswer: New York City.", task("New York"))
    assert result.score == pytest.approx(0.8) and not result.correct
    assert result.info == {"qa/em": 0.0, "qa/f1": pytest.approx(0.8), "answer_missing": 0.0}
    with pytest.raises(ValueError):
        QAScorer("bleu")


def test_empty_output_scores_zero():
    result = QAScorer("f1")("", task("Paris"))
    assert (result.score, result.correct) == (0.0, False)
    assert result.info["answer_missing"] == 1.0


def test_qa_reward_reads_the_final_answer_line():
    reward = qa_reward(cost=None)
    result = reward(single_turn("The capital...\nAnswer: Paris.\n"), task("paris"))
    assert result.correct and result.score == 1.0
