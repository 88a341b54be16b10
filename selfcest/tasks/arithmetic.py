"""Synthetic big-integer arithmetic, as the paper's generator (docs/reference.md §5.1) but seeded.

One expression is drawn as `draw_expression` says (every number is a field of
`ArithmeticConfig`).

Written with ASCII operators, e.g. ``4821 * (373 - 90211) + 5510``. Prompt:
``Calculate the value of {expression}.``; answer: the integer as a string.
"""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass
from typing import Any

from selfcest.task import Task
from selfcest.tasks.splits import TaskSplits, config_of, draw_distinct

SOURCE = "arithmetic"
PROMPT = "Calculate the value of {expression}."

_ADDITIVE = ("+", "-")


@dataclass(frozen=True)
class ArithmeticConfig:
    """Knobs of the expression generator (defaults: the paper's generator)."""

    ops_min: int = 3  # fewest operators per expression
    ops_max: int = 10  # most operators per expression
    digits_min: int = 3  # fewest digits per operand
    digits_max: int = 7  # most digits per operand
    weight_add: float = 4.0  # relative frequency of "+"
    weight_sub: float = 3.0  # relative frequency of "-"
    weight_mul: float = 6.0  # relative frequency of "*"
    paren_prob: float = 0.55  # chance that a candidate (a ± b) next to a "*" gets parentheses
    max_parens: int = 2  # most local pairs per expression
    wide_paren_prob: float = 0.22  # chance of one wide pair over a run of operands
    wide_span_min: int = 3  # fewest operands inside the wide pair
    wide_span_max: int = 5  # most operands inside the wide pair
    max_result_digits: int = 16  # redraw until |value| has at most this many digits
    attempts: int = 2000  # draws before giving up on the result-size cap

    def __post_init__(self) -> None:
        if not 1 <= self.ops_min <= self.ops_max:
            raise ValueError(f"need 1 <= ops_min <= ops_max, got {self.ops_min}, {self.ops_max}")
        if not 1 <= self.digits_min <= self.digits_max:
            raise ValueError(
                f"need 1 <= digits_min <= digits_max, got {self.digits_min}, {self.digits_max}"
            )
        weights = (self.weight_add, self.weight_sub, self.weight_mul)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"operator weights must be >= 0 with a positive sum, got {weights}")
        for name in ("paren_prob", "wide_paren_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        # Two operands in parentheses are the local pairs' job; a wide pair spans more.
        if not 3 <= self.wide_span_min <= self.wide_span_max:
            raise ValueError("need 3 <= wide_span_min <= wide_span_max")
        if self.max_parens < 0 or self.max_result_digits < 1 or self.attempts < 1:
            raise ValueError("max_parens >= 0, max_result_digits >= 1 and attempts >= 1")


@dataclass(frozen=True)
class Expression:
    """One drawn expression and its structure."""

    text: str
    value: int
    operands: tuple[int, ...]
    operators: tuple[str, ...]
    local_pairs: tuple[int, ...]  # operator index i: operands i and i+1 are in parentheses
    wide_span: tuple[int, int] | None  # [start, stop) operand range inside the wide pair


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate_expression(text: str) -> int:
    """Value of an expression of integer literals, ``+``, ``-``, ``*`` and parentheses.

    Walks the parsed AST; any other syntax (names, calls, ``**``, ``/``, unary signs) raises
    ValueError, so nothing is ever executed.
    """
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an expression: {text!r}") from error
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"unsupported syntax in arithmetic expression: {ast.dump(node)[:80]}")


def draw_expression(rng: random.Random, config: ArithmeticConfig) -> Expression:
    """One expression within the result-size cap, drawn as follows (every number is a field of
    `ArithmeticConfig`):

    1. the number of operators k is uniform in ``[ops_min, ops_max]`` (so k + 1 operands);
    2. each operand has a digit count uniform in ``[digits_min, digits_max]`` and is uniform
       among the numbers of that many digits (so its first digit is 1-9);
    3. each operator is ``+``, ``-`` or ``*`` with weights ``weight_add : weight_sub : weight_mul``;
    4. local parentheses: an operator ``+``/``-`` with a ``*`` on either side is a candidate for a
       pair ``(a ± b)`` around its two operands; candidates are visited left to right, each
       placed with probability ``paren_prob`` if it shares no operand with an earlier pair, at
       most ``max_parens`` pairs;
    5. with probability ``wide_paren_prob``, one wide pair of parentheses spans a run of
       ``wide_span_min``-``wide_span_max`` operands (fewer than all of them); only runs whose
       operators mix ``*`` with ``+``/``-`` and that do not cut a local pair qualify, and one is
       picked uniformly (none if no run qualifies);
    6. the expression is evaluated by walking its parsed AST (`evaluate_expression`, never
       `eval`), and redrawn until ``|value|`` has at most ``max_result_digits`` digits (at most
       ``attempts`` draws).
    """
    for _ in range(config.attempts):
        expression = _draw_once(rng, config)
        if len(str(abs(expression.value))) <= config.max_result_digits:
            return expression
    raise RuntimeError(
        f"no expression with at most {config.max_result_digits} result digits in "
        f"{config.attempts} attempts; relax the config: {config}"
    )


def _draw_once(rng: random.Random, config: ArithmeticConfig) -> Expression:
    n_ops = rng.randint(config.ops_min, config.ops_max)
    operands = []
    for _ in range(n_ops + 1):
        digits = rng.randint(config.digits_min, config.digits_max)
        operands.append(rng.randint(10 ** (digits - 1), 10**digits - 1))
    ops = rng.choices(
        ["+", "-", "*"], weights=[config.weight_add, config.weight_sub, config.weight_mul], k=n_ops
    )
    pairs = _local_pairs(rng, ops, config)
    wide = _wide_span(rng, ops, pairs, config)
    text = _render(operands, ops, pairs, wide)
    return Expression(text, evaluate_expression(text), tuple(operands), tuple(ops), pairs, wide)


def _local_pairs(rng: random.Random, ops: list[str], config: ArithmeticConfig) -> tuple[int, ...]:
    pairs: list[int] = []
    used: set[int] = set()  # operands already inside a pair
    for i, op in enumerate(ops):
        next_to_mul = (i > 0 and ops[i - 1] == "*") or (i + 1 < len(ops) and ops[i + 1] == "*")
        if op not in _ADDITIVE or not next_to_mul:
            continue
        # Draw for every candidate, even past the cap, so changing max_parens changes which
        # pairs are kept but not the random stream the rest of the expression is drawn from.
        place = rng.random() < config.paren_prob
        if place and len(pairs) < config.max_parens and not used & {i, i + 1}:
            pairs.append(i)
            used |= {i, i + 1}
    return tuple(pairs)


def _wide_span(
    rng: random.Random, ops: list[str], pairs: tuple[int, ...], config: ArithmeticConfig
) -> tuple[int, int] | None:
    if rng.random() >= config.wide_paren_prob:
        return None
    n_operands = len(ops) + 1
    size = rng.randint(config.wide_span_min, config.wide_span_max)
    if size >= n_operands:  # parentheses around everything would change nothing
        return None
    valid = []
    for start in range(n_operands - size + 1):
        stop = start + size
        inner = ops[start : stop - 1]
        mixes = "*" in inner and any(op in _ADDITIVE for op in inner)
        cuts_pair = any((start <= i < stop) != (start <= i + 1 < stop) for i in pairs)
        if mixes and not cuts_pair:
            valid.append((start, stop))
    return rng.choice(valid) if valid else None


def _render(
    operands: list[int], ops: list[str], pairs: tuple[int, ...], wide: tuple[int, int] | None
) -> str:
    opens = [0] * len(operands)
    closes = [0] * len(operands)
    for i in pairs:
        opens[i] += 1
        closes[i + 1] += 1
    if wide is not None:
        opens[wide[0]] += 1
        closes[wide[1] - 1] += 1
    parts = []
    for j, value in enumerate(operands):
        parts.append("(" * opens[j] + str(value) + ")" * closes[j])
        if j < len(ops):
            parts.append(ops[j])
    return " ".join(parts)


def arithmetic_task(expression: Expression, task_id: str) -> Task:
    return Task(
        id=task_id,
        prompt=PROMPT.format(expression=expression.text),
        answer=str(expression.value),
        source=SOURCE,
        metadata={
            "expression": expression.text,
            "num_ops": len(expression.operators),
            "local_parens": len(expression.local_pairs),
            "wide_paren": expression.wide_span is not None,
        },
    )


def _distinct_expressions(
    n: int, seed: int | str, config: ArithmeticConfig, seen: set
) -> list[Expression]:
    def draw(rng: random.Random) -> tuple[Any, Expression]:
        expression = draw_expression(rng, config)
        return expression.text, expression

    return draw_distinct(draw, random.Random(seed), n, seen, "arithmetic expressions")


def arithmetic_tasks(
    n: int,
    seed: int | str = 0,
    config: ArithmeticConfig | None = None,
    id_prefix: str = "arithmetic",
) -> list[Task]:
    """``n`` distinct expressions drawn with ``random.Random(seed)``; ids ``{id_prefix}-{i}``."""
    drawn = _distinct_expressions(n, seed, config or ArithmeticConfig(), set())
    return [arithmetic_task(e, f"{id_prefix}-{i}") for i, e in enumerate(drawn)]


def arithmetic_splits(
    seed: int = 0,
    train: ArithmeticConfig | None = None,
    ood: ArithmeticConfig | None = None,
    n_train: int = 900,
    n_test: int = 100,
    n_ood: int = 0,
) -> TaskSplits:
    """Disjoint train/test from ``train`` and ``n_ood`` tasks from ``ood`` (required if > 0).

    Same stream layout as `keyed_sum_splits`: train is the first ``n_train`` distinct
    expressions of ``random.Random(seed)``, test the next ``n_test``; OOD comes from a stream
    seeded ``f"{seed}:ood"``. No expression appears in two splits.
    """
    train = train or ArithmeticConfig()
    if n_ood and ood is None:
        raise ValueError("n_ood > 0 needs an ood ArithmeticConfig")
    seen: set = set()
    in_dist = _distinct_expressions(n_train + n_test, seed, train, seen)
    out_dist = _distinct_expressions(n_ood, f"{seed}:ood", ood, seen) if n_ood else []
    def tasks(drawn: list[Expression], split: str) -> list[Task]:
        return [arithmetic_task(e, f"arithmetic-{split}-{i}") for i, e in enumerate(drawn)]

    return TaskSplits(
        train=tasks(in_dist[:n_train], "train"),
        test=tasks(in_dist[n_train:], "test"),
        ood=tasks(out_dist, "ood"),
    )


def load_arithmetic(
    split: str = "train",
    seed: int = 0,
    n_train: int = 900,
    n_test: int = 100,
    n_ood: int = 0,
    train: Any = None,
    ood: Any = None,
) -> list[Task]:
    """The ``split`` ("train", "test" or "ood") of `arithmetic_splits`; ``train`` / ``ood``
    are `ArithmeticConfig`s or mappings of their fields (the task source ``arithmetic``)."""
    splits = arithmetic_splits(
        seed, config_of(ArithmeticConfig, train), config_of(ArithmeticConfig, ood),
        n_train, n_test, n_ood,
    )
    return splits[split]
