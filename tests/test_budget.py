"""Budget validation and the arithmetic that splits generation budgets."""

from __future__ import annotations

import pytest

from selfcest.budget import (
    Allowance,
    Budget,
    BudgetError,
    clone_allowance,
    clone_pools,
    fair_shares,
)


def test_budget_rejects_impossible_values_naming_the_key():
    with pytest.raises(BudgetError, match="^node_context must be >= 1"):
        Budget(node_context=0)
    with pytest.raises(BudgetError, match=r"^node_generation \(\d+\) exceeds tree_generation"):
        Budget(node_generation=500, tree_generation=100)
    with pytest.raises(BudgetError, match="must be an integer"):
        Budget(return_tokens=2.5)
    assert not Budget(max_depth=0).spawning and Budget().spawning


def test_allowance_bounds_every_call():
    a = Allowance(cap=50, pool=80)
    assert a.max_tokens(context_length=90, node_context=100) == 10  # context is the binding limit
    assert a.max_tokens(context_length=0, node_context=100) == 50  # own cap
    a.spend(45)
    a.lend([30])
    assert a.pool_left == 5 and a.max_tokens(0, 100) == 5
    child = Allowance(cap=30, pool=30, own=12)
    a.settle(30, child)
    assert a.lent == 0 and a.descendants == 12 and a.pool_left == 80 - 45 - 12
    with pytest.raises(RuntimeError, match="past a budget"):
        a.spend(6)  # own cap 50, 45 spent


def test_clone_pools_keep_a_share_for_the_parent():
    # 100 tokens left, 3 clones: shares of 100 // 4 = 25; a request for 10 is honoured, 40 is
    # clamped
    assert clone_pools(100, [None, 10, 40]) == [25, 10, 25]
    assert clone_pools(100, []) == []


def test_the_parent_reserves_no_more_than_it_can_generate():
    # 1000 left, 2 clones: an equal reserve would be 333, but the parent may only generate 40
    # more tokens itself, so the clones split the other 960
    assert clone_pools(1000, [None, None], own_left=40) == [480, 480]
    assert clone_pools(1000, [None, None], own_left=500) == [333, 333]
    assert clone_pools(1000, [None, 100], own_left=0) == [500, 100]
    assert clone_allowance(25, None, clone_cap=16).cap == 16
    assert clone_allowance(25, 8, clone_cap=16).cap == 8
    assert clone_allowance(5, None, clone_cap=16).cap == 5
    assert Budget(node_generation=100, clone_generation=30).clone_cap == 30
    assert Budget(node_generation=100).clone_cap == 100


@pytest.mark.parametrize(
    "lengths, total, per_item, expected",
    [
        ([3, 40, 40], 21, 30, [3, 9, 9]),
        ([3, 40, 40], 500, 30, [3, 30, 30]),
        ([5, 5], 7, 10, [3, 4]),
        ([], 10, 5, []),
        ([4], 0, 5, [0]),
    ],
)
def test_fair_shares(lengths, total, per_item, expected):
    keep = fair_shares(lengths, total, per_item)
    assert keep == expected
    assert sum(keep) <= max(total, 0)
