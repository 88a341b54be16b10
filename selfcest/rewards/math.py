"""Math reward: the root's final answer against the reference, by math-verify.

The answer is read from the root's **final turn only** (`final_turn_text`), never from
earlier turns (which hold spawn calls and reasoning): of the last ``\\boxed{...}`` and the
last ``Answer:`` line, whichever comes later; without either, the last non-empty line.

Comparison (`math_score`): integers in process, everything else by math-verify in a worker
process; `MathScorer` gives the rules. It never hangs (`MathVerifier`).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from selfcest.protocol import ANSWER_MARKER
from selfcest.rewards.base import TaskScore
from selfcest.rewards.compose import ComposedReward
from selfcest.rewards.cost import MATH_REFERENCE_COST, CostConfig
from selfcest.rewards.worker import LineWorker, WorkerLost, WorkerTimeout
from selfcest.task import Task
from selfcest.tasks.math import last_boxed

logger = logging.getLogger(__name__)

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_INTEGER = re.compile(r"[-−+]?(?:\d{1,3}(?:,\d{3})+|\d+)")


def math_answer(text: str) -> str:
    """The answer written in a final turn (see the module docstring for the rule)."""
    boxes = list(_BOX.finditer(text))
    markers = list(ANSWER_MARKER.finditer(text))
    box_at = boxes[-1].start() if boxes else -1
    marker_at = markers[-1].end() if markers else -1
    if marker_at > box_at:
        line = next((ln.strip() for ln in text[marker_at:].splitlines() if ln.strip()), "")
        boxed = last_boxed(line)
        return boxed if boxed is not None else line
    if boxes:
        return last_boxed(text) or ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def as_integer(text: str) -> int | None:
    """The integer ``text`` spells exactly (``"1,234"``, ``"$-5$"``, ``"80."``), else None."""
    core = text.strip().strip("$").strip().rstrip(".").strip()
    boxed = last_boxed(core) if core.startswith(("\\boxed", "\\fbox")) else None
    if boxed is not None:
        core = boxed.strip()
    if not _INTEGER.fullmatch(core):
        return None
    return int(core.replace(",", "").replace("−", "-"))


class MathVerifier:
    """math-verify behind a worker process with a per-comparison wall-clock timeout.

    Thread-safe (one comparison at a time; concurrent callers wait). The worker starts on the
    first comparison (about a second of imports, not counted in ``timeout_s``), is killed when a
    comparison times out or fails, and restarts on the next one; it is closed at exit.

    Never hangs: answers over ``max_answer_chars`` characters are wrong without parsing; parsed
    values whose magnitude bound exceeds ``max_digits`` digits (``9^9^9^9``, ``(10^7)!``) are
    wrong without verifying; and any comparison that takes longer than ``timeout_s`` seconds is
    cut off by killing the worker (wrong, counted as ``math/timeout``). math-verify is always
    called with ``parsing_timeout=None`` and ``timeout_seconds=None``: its own timeouts rely on
    ``signal.alarm`` and raise outside the main thread, so the worker's kill is the timeout.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        max_answer_chars: int = 1000,
        max_digits: int = 100_000,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.timeout_s = timeout_s  # seconds one comparison may take
        self.max_answer_chars = max_answer_chars  # longer answers are wrong unparsed
        self.max_digits = max_digits  # larger parsed values are wrong unverified
        self._worker = LineWorker("selfcest.rewards._math_worker",
                                  startup_timeout_s=startup_timeout_s)

    @property
    def restarts(self) -> int:
        """Workers killed after a timeout or a crash."""
        return self._worker.restarts

    def compare(self, prediction: str, gold: str) -> str:
        """A verdict: ``equal``, ``different``, ``unparsed``, ``too_long``, ``too_large``,
        ``gold_unparsed``, ``timeout`` or ``error`` (only ``equal`` is correct)."""
        if len(prediction) > self.max_answer_chars:
            return "too_long"
        readings = [prediction]
        if "$" not in prediction and not _BOX.search(prediction):
            readings.insert(0, "\\boxed{" + prediction + "}")
        if "$" not in gold and not _BOX.search(gold):
            gold = "\\boxed{" + gold + "}"
        request = {"predictions": readings, "gold": gold, "max_digits": self.max_digits}
        try:
            response = self._worker.ask(request, self.timeout_s)
        except WorkerTimeout:
            logger.warning("math-verify took over %.1f s on %r; worker restarted", self.timeout_s,
                           prediction[:80])
            return "timeout"
        except WorkerLost as error:
            logger.warning("math-verify worker lost (%s); restarting", error)
            return "error"
        if "failed" in response:
            logger.warning("math-verify failed on %r: %s", prediction[:80], response["failed"])
            return "error"
        return response["verdict"]

    def close(self) -> None:
        self._worker.close()


_shared: MathVerifier | None = None
_shared_lock = threading.Lock()


def shared_verifier() -> MathVerifier:
    """The process-wide default verifier (one worker process for all math rewards)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MathVerifier()
        return _shared


@dataclass(frozen=True)
class MathScorer:
    """Task scorer for math answers: 1.0 if the final answer equals the reference, else 0.

    ``info`` reports the verdict as ``math/<verdict>`` = 1.0 (e.g. ``math/timeout``), so
    averaged over a batch it gives the rate of each outcome, and ``answer_missing`` (1.0 when
    the final turn holds no answer).

    Comparison (`math_score`):

    1. An integer reference (``"1,234"``, ``"80"``) and an answer written as a plain integer
       (commas as thousands separators, optional ``$...$`` or a trailing period) are compared
       as Python integers, in process.
    2. Everything else goes to math-verify (`math_verify.parse` / `verify`) in a worker process
       (`MathVerifier`). The answer is read twice, as written and wrapped in ``\\boxed{}`` (so a
       bare ``3\\sqrt2`` or ``\\dfrac{1}{2}`` is read as LaTeX); it is correct if either reading
       verifies.
    """

    verifier: MathVerifier | None = field(default=None, compare=False)  # None: shared one

    def __call__(self, text: str, task: Task) -> TaskScore:
        answer = math_answer(text)
        if not answer:
            verdict = "empty"
        else:
            gold_int, answer_int = as_integer(task.answer), as_integer(answer)
            if gold_int is not None and answer_int is not None:
                verdict = "equal" if gold_int == answer_int else "different"
            else:
                verdict = (self.verifier or shared_verifier()).compare(answer, task.answer)
        correct = verdict == "equal"
        info = {f"math/{verdict}": 1.0, "answer_missing": float(verdict == "empty")}
        return TaskScore(float(correct), correct, info)


def math_reward(
    *, cost: CostConfig | dict | None = MATH_REFERENCE_COST, **options: Any
) -> ComposedReward:
    """The math reward: `MathScorer` minus ``cost`` (default: the reference math shaping,
    ``max(0, s - min(P_root + P_clone, 0.5))``); ``options`` go to `ComposedReward`."""
    return ComposedReward(MathScorer(), cost, **options)
