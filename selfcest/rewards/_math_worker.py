"""The math-verify worker process behind `selfcest.rewards.math.MathVerifier`.

Run as ``python -m selfcest.rewards._math_worker`` (a `selfcest.rewards.worker` process). It
says it is ready once math-verify is imported, then answers each JSON line ``{"predictions":
[...], "gold": "...", "max_digits": N}`` on stdin with one JSON line ``{"verdict": ...}``.

Why a process: both `math_verify.parse` and `math_verify.verify` can run for hours on short
inputs (``9^9^9^9`` is parsed as a power tower that ``verify`` tries to expand;
``\\binom{10^7}{5 \\cdot 10^6}`` is expanded while parsing), and math-verify's own timeout uses
``signal.alarm``, which only works in the main thread. The parent kills this process when an
answer takes too long, which no in-process guard can do to a running sympy computation.

Why also screening (`log10_bound`): a kill costs a restart (about a second of imports), so
answers whose parsed value is provably astronomically large are rejected before ``verify``.
"""

from __future__ import annotations

import logging
import math
import sys

from selfcest.rewards.worker import serve

LOG10_2 = math.log10(2)
# log10 bounds above this are treated as infinite (10**MAX_LOG10 would overflow a float).
MAX_LOG10 = 300.0


def log10_bound(expr) -> float:
    """A cheap upper bound on log10 of the largest magnitude evaluating ``expr`` can reach.

    Works on the unevaluated sympy tree that `math_verify.parse` returns: integers and
    rationals by their size, ``Add`` by its largest term (+ log10 of the term count), ``Mul``
    by the sum of its factors, ``b**e`` by ``bound(b) * |e|``, ``exp(x)`` by
    ``|x| * log10(e)``, factorial-like functions of n by ``n * log10(n + 1)``; atoms (symbols,
    constants) count as magnitude 10; any other node as its largest argument. Returns
    ``math.inf`` when the bound itself would overflow.
    """
    import sympy
    from sympy.matrices import MatrixBase

    if isinstance(expr, MatrixBase):
        return max((log10_bound(e) for e in expr), default=0.0)
    if not isinstance(expr, sympy.Basic):
        return 0.0  # math-verify's string readings
    if expr.is_Integer:
        return math.log10(abs(int(expr))) if expr != 0 else 0.0
    if expr.is_Rational:
        return max(math.log10(abs(int(expr.p))), math.log10(int(expr.q)))
    if expr.is_Float:
        mantissa, exponent = expr._mpf_[1], expr._mpf_[2]
        return abs(exponent + int(mantissa).bit_length()) * LOG10_2 if mantissa else 0.0
    if isinstance(expr, sympy.Pow):
        base, exponent = expr.args
        return _bounded(max(log10_bound(base), 0.0) * _abs_bound(exponent))
    if isinstance(expr, sympy.exp):
        return _bounded(_abs_bound(expr.args[0]) * math.log10(math.e))
    if isinstance(expr, _factorial_like()):
        n = max(_abs_bound(arg) for arg in expr.args)
        return _bounded(n * math.log10(n + 1)) if math.isfinite(n) else math.inf
    if not expr.args:
        return 1.0
    bounds = [log10_bound(arg) for arg in expr.args]
    if isinstance(expr, sympy.Mul):
        return _bounded(sum(bounds))
    if isinstance(expr, sympy.Add):
        return _bounded(max(bounds) + math.log10(len(bounds)))
    return max(bounds)


def _abs_bound(expr) -> float:
    """An upper bound on |expr| itself (not its log)."""
    if getattr(expr, "is_Number", False) and expr.is_finite:
        try:
            return abs(float(expr))
        except OverflowError:
            return math.inf
    log10 = log10_bound(expr)
    return math.inf if log10 > MAX_LOG10 else 10.0**log10


def _bounded(value: float) -> float:
    return math.inf if not value < 10.0**MAX_LOG10 else value


def _factorial_like() -> tuple[type, ...]:
    import sympy

    return (
        sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma,
        sympy.RisingFactorial, sympy.FallingFactorial, sympy.binomial,
    )


def compare(predictions: list[str], gold: str, max_digits: float) -> str:
    """Verdict on whether any reading of the prediction equals the gold answer.

    ``"equal"``, ``"different"``, ``"unparsed"`` (math-verify found nothing in any reading),
    ``"too_large"`` (a parsed value exceeds ``max_digits`` decimal digits by `log10_bound`),
    or ``"gold_unparsed"`` (the gold cannot be parsed and differs from the prediction as text).
    """
    from math_verify import parse, verify

    gold_parsed = parse(gold, parsing_timeout=None)
    if not gold_parsed:
        same = any("".join(p.split()) == "".join(gold.split()) for p in predictions)
        return "equal" if same else "gold_unparsed"
    if any(log10_bound(g) > max_digits for g in gold_parsed):
        return "too_large"
    verdict = "unparsed"
    for prediction in predictions:
        parsed = parse(prediction, parsing_timeout=None)
        if not parsed:
            continue
        if any(log10_bound(p) > max_digits for p in parsed):
            verdict = "too_large"
            continue
        if verify(gold_parsed, parsed, timeout_seconds=None):
            return "equal"
        if verdict == "unparsed":
            verdict = "different"
    return verdict


def setup() -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the timeout-disabled notice
    # Integers above 4300 digits cannot be printed by default and sympy prints while comparing;
    # screening (max_digits) and the parent's timeout bound what this unlocks.
    if hasattr(sys, "set_int_max_str_digits"):  # Python >= 3.10.7
        sys.set_int_max_str_digits(0)
    import math_verify  # noqa: F401
    import sympy  # noqa: F401


def answer(request: dict) -> dict:
    return {"verdict": compare(request["predictions"], request["gold"], request["max_digits"])}


if __name__ == "__main__":
    serve(answer, setup)
