import re

import pytest

from selfcest.tasks.arithmetic import (
    ArithmeticConfig,
    arithmetic_splits,
    arithmetic_tasks,
    evaluate_expression,
)

TOKEN = re.compile(r"\(|\)|\d+|[+*-]")


def structure(text):
    """Independent reading of an expression: operands, operators and parenthesised groups.

    Returns (operands, operators, groups) where each group is the [start, stop) range of
    operand indices inside one pair of parentheses.
    """
    operands, operators, groups, stack = [], [], [], []
    for token in TOKEN.findall(text):
        if token == "(":
            stack.append(len(operands))
        elif token == ")":
            groups.append((stack.pop(), len(operands)))
        elif token.isdigit():
            operands.append(token)
        else:
            operators.append(token)
    assert not stack
    return operands, operators, groups


def value_of(text):
    """A recursive-descent evaluator written for the test (no eval)."""
    tokens = TOKEN.findall(text)
    pos = 0

    def atom():
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token == "(":
            value = expr()
            pos += 1  # ")"
            return value
        return int(token)

    def term():
        nonlocal pos
        value = atom()
        while pos < len(tokens) and tokens[pos] == "*":
            pos += 1
            value *= atom()
        return value

    def expr():
        nonlocal pos
        value = term()
        while pos < len(tokens) and tokens[pos] in "+-":
            op = tokens[pos]
            pos += 1
            value = value + term() if op == "+" else value - term()
        return value

    return expr()


def expression(task):
    prefix, suffix = "Calculate the value of ", "."
    assert task.prompt.startswith(prefix) and task.prompt.endswith(suffix)
    return task.prompt[len(prefix) : -len(suffix)]


def test_deterministic_for_a_seed():
    assert arithmetic_tasks(20, seed=3) == arithmetic_tasks(20, seed=3)
    assert arithmetic_tasks(20, seed=3) != arithmetic_tasks(20, seed=4)


def test_default_knobs_hold_on_many_samples():
    config = ArithmeticConfig()
    tasks = arithmetic_tasks(300, seed=0, config=config)
    assert len({t.prompt for t in tasks}) == 300
    wide_seen = local_seen = 0
    for task in tasks:
        text = expression(task)
        operands, ops, groups = structure(text)
        assert config.ops_min <= len(ops) <= config.ops_max
        assert len(operands) == len(ops) + 1
        assert all(3 <= len(o) <= 7 and o[0] != "0" for o in operands)
        assert int(task.answer) == value_of(text)
        assert len(str(abs(int(task.answer)))) <= 16
        local = [g for g in groups if g[1] - g[0] == 2]
        wide = [g for g in groups if g[1] - g[0] > 2]
        assert len(local) <= 2 and len(wide) <= 1
        for start, stop in local:
            i = start  # the operator between the two operands
            assert ops[i] in "+-"
            assert (i > 0 and ops[i - 1] == "*") or (i + 1 < len(ops) and ops[i + 1] == "*")
        for start, stop in wide:
            inner = ops[start : stop - 1]
            assert 3 <= stop - start <= 5 and stop - start < len(operands)
            assert "*" in inner and ("+" in inner or "-" in inner)
        wide_seen += bool(wide)
        local_seen += bool(local)
    # Both kinds of parentheses really occur (0.22 and 0.55 chances per expression).
    assert 20 < wide_seen < 120 and local_seen > 100


def test_operator_digit_and_result_knobs():
    config = ArithmeticConfig(
        ops_min=2, ops_max=4, digits_min=1, digits_max=2, max_result_digits=4,
        weight_sub=0.0,
    )
    for task in arithmetic_tasks(200, seed=1, config=config):
        operands, ops, _ = structure(expression(task))
        assert 2 <= len(ops) <= 4
        assert all(1 <= len(o) <= 2 for o in operands)
        assert "-" not in ops
        assert len(str(abs(int(task.answer)))) <= 4


def test_parentheses_need_mixed_operators():
    only_add = ArithmeticConfig(weight_sub=0.0, weight_mul=0.0, paren_prob=1.0, wide_paren_prob=1.0)
    only_mul = ArithmeticConfig(
        weight_add=0.0, weight_sub=0.0, paren_prob=1.0, wide_paren_prob=1.0,
        digits_min=1, digits_max=1, ops_max=5,
    )
    for config in (only_add, only_mul):
        for task in arithmetic_tasks(50, seed=2, config=config):
            assert "(" not in task.prompt


def test_parentheses_off_and_always_on():
    off = ArithmeticConfig(paren_prob=0.0, wide_paren_prob=0.0)
    assert all("(" not in t.prompt for t in arithmetic_tasks(100, seed=0, config=off))
    on = ArithmeticConfig(paren_prob=1.0, max_parens=1, wide_paren_prob=0.0)
    for task in arithmetic_tasks(100, seed=0, config=on):
        operands, ops, groups = structure(expression(task))
        has_candidate = any(
            op in "+-" and "*" in ops[max(0, i - 1) : i] + ops[i + 1 : i + 2]
            for i, op in enumerate(ops)
        )
        assert len(groups) == (1 if has_candidate else 0)


def test_unreachable_result_cap_raises():
    config = ArithmeticConfig(weight_add=0, weight_sub=0, max_result_digits=2, attempts=20)
    with pytest.raises(RuntimeError, match="attempts"):
        arithmetic_tasks(1, config=config)


@pytest.mark.parametrize(
    "bad", [dict(ops_min=0), dict(ops_min=5, ops_max=4), dict(digits_min=0),
            dict(weight_add=0, weight_sub=0, weight_mul=0), dict(paren_prob=1.5),
            dict(wide_span_min=2)],
)
def test_invalid_config(bad):
    with pytest.raises(ValueError):
        ArithmeticConfig(**bad)


def test_evaluator_walks_the_ast_only():
    assert evaluate_expression("(12 - 5) * 3 + 1") == 22
    for text in ("2 ** 3", "7 / 2", "__import__('os')", "-3", "abs(1)", "1 +"):
        with pytest.raises(ValueError):
            evaluate_expression(text)


def test_splits_are_disjoint_and_stable():
    ood = ArithmeticConfig(ops_min=11, ops_max=12, digits_min=1, digits_max=2)
    splits = arithmetic_splits(seed=5, ood=ood, n_train=40, n_test=10, n_ood=10)
    prompts = [{t.prompt for t in splits[s]} for s in ("train", "test", "ood")]
    assert [len(p) for p in prompts] == [40, 10, 10]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    assert all(len(structure(expression(t))[1]) >= 11 for t in splits.ood)
    again = arithmetic_splits(seed=5, ood=ood, n_train=40, n_test=3, n_ood=2)
    assert again.train == splits.train
    assert splits.train[0].id == "arithmetic-train-0" and splits.ood[0].id == "arithmetic-ood-0"
    with pytest.raises(ValueError, match="ood"):
        arithmetic_splits(n_ood=5)
