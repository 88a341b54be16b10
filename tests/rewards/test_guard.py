"""A user's reward that fails on a tree scores it 0, counted, and a hang is cut off."""

from __future__ import annotations

import math
import textwrap
import time

import pytest
from reward_tree_builders import single_turn

from selfcest.rewards.base import RewardResult
from selfcest.rewards.guard import GuardedReward, RewardFailed, RewardProcess, RewardTimeout
from selfcest.rewards.worker import WorkerStartError
from selfcest.task import Task

TASK = Task("t", "What is 3 + 4?", "7")


def boom(tree, task):
    raise ValueError("boom")


@pytest.mark.parametrize("reward, why", [
    (boom, "ValueError: boom"),
    (lambda tree, task: RewardResult(math.nan, True),
     "returned the score nan, not a finite number"),
    (lambda tree, task: RewardResult(math.inf, True),
     "returned the score inf, not a finite number"),
    (lambda tree, task: RewardResult("high", True),
     "returned the score 'high', not a finite number"),
    (lambda tree, task: 0.5, "returned 0.5, not a RewardResult"),
    (lambda tree, task: RewardResult(1.0, True, node_rewards={"0.0": math.nan}),
     "returned node rewards that are not finite numbers: {'0.0': nan}"),
])
def test_a_failing_reward_scores_the_tree_0_and_says_why(reward, why):
    guarded = GuardedReward(reward)
    result = guarded(single_turn("Answer: 7"), TASK)
    assert (result.score, result.correct, result.info) == (0.0, False, {"errors": 1.0})
    assert guarded.failures == [f"tree t#0: {why}"]


def test_a_sound_result_passes_untouched():
    result = RewardResult(0.25, False, node_rewards={"0": 1.0}, info={"task_score": 0.25})
    guarded = GuardedReward(lambda tree, task: result)
    assert guarded(single_turn("Answer: 7"), TASK) is result and guarded.failures == []


def reward_file(tmp_path) -> str:
    path = tmp_path / "moody.py"
    path.write_text(textwrap.dedent("""
        import time
        from selfcest.rewards.base import RewardResult

        def reward(tree, task):
            text = tree.root.final_text
            if "hang" in text:
                # Past every bound below: a hang not cut off fails the test, not stalls it.
                time.sleep(60)
            if "raise" in text:
                raise KeyError("no such field")
            if "odd" in text:
                return "odd"
            return RewardResult(float(tree.answer == task.answer), tree.answer == task.answer,
                                info={"length": len(text)})
        """))
    return f"{path}:reward"


def test_a_reward_process_cuts_a_hang_off_and_answers_the_next_call(tmp_path):
    process = RewardProcess(reward_file(tmp_path), None, timeout_s=1.0)
    try:
        right = process(single_turn("Answer: 7"), TASK)  # the worker is up before timing
        assert (right.score, right.correct, right.info) == (1.0, True, {"length": 9})
        start = time.monotonic()
        with pytest.raises(RewardTimeout, match=r"the reward took over 1 s "
                                                r"\(task.reward_timeout_s\) and was cut off"):
            process(single_turn("Answer: hang"), TASK)
        assert time.monotonic() - start < 10  # the hang would take a minute
        with pytest.raises(RewardFailed, match="^KeyError: 'no such field'$"):
            process(single_turn("Answer: raise"), TASK)
        with pytest.raises(TypeError, match="returned 'odd', not a RewardResult"):
            process(single_turn("Answer: odd"), TASK)
        # the same worker: no restart after a raise
        assert process(single_turn("Answer: 8"), TASK).score == 0.0
        assert process._worker.restarts == 1
    finally:
        process.close()


def test_the_guard_counts_timeouts_apart_from_errors(tmp_path):
    guarded = GuardedReward(RewardProcess(reward_file(tmp_path), None, timeout_s=1.0))
    try:
        # The hang last: no worker to start again after it.
        results = [guarded(single_turn(f"Answer: {text}"), TASK) for text in ("7", "raise", "hang")]
    finally:
        guarded.close()
    assert [r.info for r in results] == [{"length": 9}, {"errors": 1.0}, {"timeouts": 1.0}]
    assert guarded.failures[0] == "tree t#0: KeyError: 'no such field'"


def test_a_reward_that_cannot_load_in_its_worker_stops_at_once(tmp_path):
    """Not one tree's failure: every call would fail the same way."""
    guarded = GuardedReward(RewardProcess(f"{tmp_path}/missing.py:reward", None, timeout_s=1.0))
    with pytest.raises(WorkerStartError, match="did not start: ValueError: reward spec .*no file"):
        guarded(single_turn("Answer: 7"), TASK)
