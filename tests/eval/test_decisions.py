"""Delegation decisions: the three modes on a scripted root, and the per-size statistics on
rows whose answers are known."""

from __future__ import annotations

import pytest
from eval_helpers import exact_match

from selfcest.budget import Budget
from selfcest.eval.decisions import Decision, Mode, per_size, sample_decisions
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.scripted import ScriptedBackend
from selfcest.task import Task

TASKS = [Task(f"t{i}", f"Add all numbers.\n[L1] {i}\n[L2] 1", str(i + 1), {"L1": str(i), "L2": "1"})
         for i in range(3)]


def direct_root(prompt: str) -> str:
    """A root that adds the lists itself, or, with a call already open, hands one clone
    each key and adds their answers; clones answer their list."""
    assistant = prompt.rsplit("<|im_start|>assistant\n", 1)[1]
    user = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    if "<return>" in assistant:
        answers = assistant.rsplit("<return>", 1)[1].split("</return>")[0].split("<sep>")
        return f"Answer: {sum(int(a) for a in answers)}"
    if assistant.endswith("<spawn>"):
        return "sum @L1<sep>sum @L2</spawn>"
    numbers = [int(n) for line in user.splitlines() if line.startswith("[")
               for n in line.split()[1:]]
    return f"Answer: {sum(numbers)}"


def decide(tiny_policy, mode: Mode, budget=Budget(max_depth=1)) -> list[Decision]:
    return sample_decisions(tiny_policy, TASKS, mode, budget, SamplingParams(), exact_match,
                            samples=2, backend=ScriptedBackend(tiny_policy.tokenizer, direct_root))


def test_free_and_direct_roots_solve_alone_and_a_forced_root_delegates(tiny_policy):
    free, direct, forced = (decide(tiny_policy, mode) for mode in Mode)
    assert len(free) == len(direct) == len(forced) == 2 * len(TASKS)
    for row in free + direct:
        assert not row.delegated and row.clones == 0 and row.correct
    for row in forced:
        assert row.delegated and row.clones == 2 and row.correct and row.size == 2
        assert row.mode == "delegate"
    assert min(r.generated_tokens for r in forced) > max(r.generated_tokens for r in free)


def test_forced_direct_disables_spawning_whatever_the_budget_allows(tiny_policy):
    """A root that tries to spawn in direct mode reads an error notice and starts no clone."""
    def spawner(prompt: str) -> str:
        assistant = prompt.rsplit("<|im_start|>assistant\n", 1)[1]
        return "Answer: 0" if "</return>" in assistant else "<spawn>sum @L1</spawn>"

    rows = sample_decisions(tiny_policy, TASKS, Mode.DIRECT, Budget(max_depth=3), SamplingParams(),
                            exact_match, backend=ScriptedBackend(tiny_policy.tokenizer, spawner))
    assert all(row.delegated and row.clones == 0 for row in rows)


def row(task: str, size: int, mode: str, reward: float, delegated=False, clones=0) -> Decision:
    return Decision(task, size, mode, reward, reward > 0.5, delegated, clones, 10, 10)


def test_per_size_averages_each_task_first_and_names_the_better_style():
    rows = []
    for i in range(20):
        # size 2: direct clearly better; free delegates on one sample of every task
        rows += [row(f"a{i}", 2, "direct", 1.0), row(f"a{i}", 2, "delegate", 0.0, True, 2),
                 row(f"a{i}", 2, "free", 1.0),
                 row(f"a{i}", 2, "free", 0.0, True, 4 if i == 0 else 2)]
        # size 5: the forced styles alternate which one wins: a tie
        rows += [row(f"b{i}", 5, "direct", float(i % 2)),
                 row(f"b{i}", 5, "delegate", float(1 - i % 2), True, 3),
                 row(f"b{i}", 5, "free", 1.0, True, 3)]
    small, large = per_size(rows, resamples=200)
    assert (small.size, small.tasks, large.size) == (2, 20, 5)
    assert small.delegation_rate.value == pytest.approx(0.5)
    # every task: 1 of 2
    assert small.delegation_rate.low == small.delegation_rate.high == pytest.approx(0.5)
    assert small.branching.value == pytest.approx((4 + 19 * 2) / 20)  # delegating trees only
    assert small.reward[
        "free"].value == pytest.approx(0.5) and small.accuracy["direct"].value == 1.0
    assert small.delegate_gain.value == pytest.approx(-1.0) and small.better == "direct"
    assert large.delegate_gain.low < 0 < large.delegate_gain.high and large.better == "tie"
    assert large.delegation_rate.value == 1.0 and large.branching.value == 3.0
    flipped = [Decision(r.task_id, r.size,
                        {"direct": "delegate", "delegate": "direct"}.get(r.mode, r.mode),
                        r.reward, r.correct, r.delegated, r.clones, 10, 10) for r in rows]
    assert per_size(flipped, resamples=200)[0].better == "delegate"


def test_sizes_measured_without_the_forced_modes_have_no_oracle():
    (only,) = per_size([row("a", 3, "free", 1.0, True, 2)], resamples=50)
    assert only.delegate_gain is None and only.better == "tie" and set(only.reward) == {"free"}


def test_a_real_model_that_always_spawns_solves_alone_when_forced_direct(
    spawning_policy, demo_task):
    """The overfit policy opens a spawn call first every time; forced direct, it never does
    (the spawn-open token is not sampled), and forced delegate it always does."""
    def run(mode: Mode) -> list[Decision]:
        return sample_decisions(spawning_policy, [demo_task], mode,
                                Budget(max_depth=1, node_generation=24),
                                SamplingParams(), exact_match, samples=8)

    free, direct, forced = run(Mode.FREE), run(Mode.DIRECT), run(Mode.DELEGATE)
    assert all(d.delegated and d.clones == 2 for d in free + forced)
    assert not any(d.delegated or d.clones for d in direct)
