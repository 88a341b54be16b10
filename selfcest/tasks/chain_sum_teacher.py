"""A scripted teacher for reasoning-gym ``chain_sum`` tasks, in the tool-call protocol.

`ChainSumTeacher` plays every agent of a clone tree for tasks made by
``load_tasks("gym", dataset="chain_sum", ...)`` (questions such as ``State the final answer to
the following arithmetic problem: 15 - 43 - 75 + 8 =``), writing turns for
`selfcest.protocol.ToolCallProtocol` (Hermes ``<tool_call>`` JSON calling ``spawn_clone``),
as SmolLM2-135M-Instruct or ``ClonePolicy.build_tiny(protocol="tool")`` render them. Like
`selfcest.tasks.keyed_sum_teacher.KeyedSumTeacher` it maps a node's prompt text to its next
turn; a ``warm_start`` config section names it ``teacher: chain_sum`` (`selfcest.tasks.TEACHERS`).

The turns it writes (delegate, solve, repair a malformed call) are described in
`ChainSumTeacher`'s docstring.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)
# A chain sum: an integer, then (+|-) integer pairs; reasoning-gym writes "15 - 43 + 8" and,
# with allow_negation, "15 + -43".
_CHAIN = re.compile(r"(-?\d+)((?:\s*[+-]\s*-?\d+)*)\s*=?\s*$")
_STEP = re.compile(r"([+-])\s*(-?\d+)")
_RETURN_LINE = re.compile(r"^\s*\d+\s*:\s*(.*?)\s*$")
_INTEGER = re.compile(r"-?\d+")

# The malformed first calls of repair demonstrations, as a function of the correct call's
# JSON: the ways SmolLM2-135M-Instruct's sampled calls failed to parse (docs/smollm.md).
MALFORMED = {
    "empty": lambda call: "",
    "name": lambda call: call.replace('"spawn_clone"', '"tool_call"', 1),
    "json": lambda call: call[:-1],
}


def parse_chain(text: str) -> list[int]:
    """The signed terms of the chain sum that ends ``text``: ``"...: 15 - 43 + 8 ="`` gives
    ``[15, -43, 8]``. Raises ValueError when ``text`` does not end with one."""
    match = _CHAIN.search(text.strip())
    if match is None:
        raise ValueError(f"no chain sum (like '12 + 7 - 3') at the end of {text!r}")
    terms = [int(match.group(1))]
    for op, number in _STEP.findall(match.group(2)):
        terms.append(int(number) if op == "+" else -int(number))
    return terms


def write_chain(terms: Sequence[int]) -> str:
    """``[15, -43, 8]`` as ``"15 - 43 + 8"``; a leading negative term keeps its sign
    (``[-75, 8]`` is ``"-75 + 8"``)."""
    parts = [str(terms[0])]
    for term in terms[1:]:
        parts.append(f"- {-term}" if term < 0 else f"+ {term}")
    return " ".join(parts)


def running_computation(terms: Sequence[int]) -> tuple[list[str], int]:
    """One line per operation (``15 - 43 = -28``, ``-28 + 8 = -20``) and the result; no line
    for a single term."""
    total, lines = terms[0], []
    for term in terms[1:]:
        new = total + term
        op = f"- {-term}" if term < 0 else f"+ {term}"
        lines.append(f"{total} {op} = {new}")
        total = new
    return lines, total


def pieces(terms: Sequence[int], count: int) -> list[list[int]]:
    """The terms cut into ``count`` contiguous pieces whose lengths differ by at most one,
    the longer ones first: 5 terms in 2 pieces are 3 + 2, 4 terms in 3 pieces 2 + 1 + 1."""
    if not 1 <= count <= len(terms):
        raise ValueError(f"cannot cut {len(terms)} terms into {count} pieces")
    size, longer = divmod(len(terms), count)
    out, start = [], 0
    for n in range(count):
        end = start + size + (n < longer)
        out.append(list(terms[start:end]))
        start = end
    return out


@dataclass
class ChainSumTeacher:
    """Correct chain_sum demonstrations in the tool-call protocol.

    A root whose prompt offers the ``spawn_clone`` tool and that sees an expression of at least
    ``min_delegate_terms`` terms delegates with probability ``delegate``: it cuts the terms into
    2 to ``max_pieces`` contiguous pieces of near-equal length (the count drawn uniformly, at
    most one piece per term) and spawns one clone per piece, each with a self-contained
    objective. A piece is copied as written, with the operator in front of it folded into its
    first number, so the root's answers simply add up::

        <tool_call>
        {"name": "spawn_clone", "arguments": {"objectives": ["Compute 15 - 43", "Compute -75 + 8"]}}
        </tool_call>
        ... the clones answer -28 and -67; the root resumes after the tool response:
        -28 - 67 = -95
        Answer: -95<|im_end|>

    Otherwise (and always in a clone) the node solves its expression directly with a short
    running computation, one operation per line::

        15 - 43 = -28
        -28 - 75 = -103
        -103 + 8 = -95
        Answer: -95<|im_end|>

    With probability ``repair`` a delegating root's first call is malformed instead, in one of
    the ways SmolLM2-135M was seen to fail (`MALFORMED`: an empty call, the tool named
    ``tool_call``, the JSON cut short); the engine answers it with an error notice, and the root
    then writes the correct call. Such a demonstration shows a model how to recover from its
    own mistake; the warm start never trains on the malformed call itself
    (`selfcest.train.sft.sft_samples` masks every turn the engine rejected), and the repaired
    call is only admitted where ``spawn_rounds`` allows a second call.

    Every turn that ends a node's work ends with ``end`` (the chat template's end-of-turn text;
    ``<|im_end|>`` for SmolLM2 and the tiny models). A prompt the teacher cannot read (no chain
    sum in its first user message, clone answers that are not integers) raises ValueError, which
    fails that node and so drops its tree from the demonstrations.
    """

    # Probability that a root whose expression has at least `min_delegate_terms` terms
    # delegates pieces of it to clones instead of solving it directly.
    delegate: float = 0.5
    # Fewest terms a root delegates (below that, the call costs more than the sum).
    min_delegate_terms: int = 3
    # Most pieces (clones) a delegating root cuts its terms into; 2 gives halves. Above 2,
    # demonstrations also show a root adding three or more answers, which a root that cuts a
    # longer chain than it was shown into more pieces needs.
    max_pieces: int = 2
    # First word of every clone objective; a user message that starts with it is a clone's.
    objective_prefix: str = "Compute"
    # The tool's name; a root delegates only if its prompt (before the question) names it.
    tool_name: str = "spawn_clone"
    # The chat template's end-of-turn text, which closes every final turn.
    end: str = "<|im_end|>"
    # Probability that a delegating root first writes a malformed call (one of `MALFORMED`,
    # drawn uniformly), reads the engine's error notice, and then writes the correct call.
    repair: float = 0.0
    # Seed of the teacher's own draws (whether a root delegates, and how).
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("delegate", "repair"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability, got {getattr(self, name)}")
        if self.min_delegate_terms < 2:
            raise ValueError(f"min_delegate_terms must be >= 2, got {self.min_delegate_terms}")
        if self.max_pieces < 2:
            raise ValueError("max_pieces must be >= 2 (a delegating root spawns 2+ clones), got "
                             f"{self.max_pieces}")
        if not self.objective_prefix.strip():
            raise ValueError("objective_prefix must be a word, got an empty string")
        self._rng = random.Random(self.seed)

    def __call__(self, prompt: str) -> str:
        user = _USER.search(prompt)
        if user is None:
            raise ValueError("ChainSumTeacher: no ChatML user message in the prompt "
                             f"{prompt[-200:]!r}")
        # The question is the first user message; what follows it is the node's own turns
        # and the tool responses (templates without a tool role render them as user messages).
        question = user.group(1).strip()
        terms = parse_chain(question)
        returned = _TOOL_RESPONSE.findall(prompt[user.end():])
        if len(returned) == 1 and _is_notice(returned[0]):  # its malformed call was rejected
            return self._spawn(terms)
        if returned:  # resumed after the clones answered: add their answers
            return self._combine(returned[-1])
        is_clone = question.startswith(self.objective_prefix + " ")
        # A root may delegate only where its prompt offers the tool (a root that may not
        # spawn is shown none, see ToolCallProtocol.root_prompt).
        offered = self.tool_name in prompt[: user.start()]
        if offered and not is_clone and len(
            terms) >= self.min_delegate_terms and self._rng.random() < self.delegate:
            # No draw when repair is off, so existing configs keep their demonstrations.
            if self.repair and self._rng.random() < self.repair:
                return self._spawn(terms, malformed=self._rng.choice(sorted(MALFORMED)))
            return self._spawn(terms)
        return self._solve(terms)

    # ------------------------------------------------------------------ turns

    def _solve(self, terms: Sequence[int]) -> str:
        lines, total = running_computation(terms)
        return "\n".join([*lines, f"Answer: {total}"]) + self.end

    def _spawn(self, terms: Sequence[int], malformed: str | None = None) -> str:
        most = min(self.max_pieces, len(terms))
        count = 2 if most == 2 else self._rng.randint(2, most)  # no draw for halves
        objectives = [f"{self.objective_prefix} {write_chain(piece)}"
                      for piece in pieces(terms, count)]
        call = json.dumps({"name": "spawn_clone", "arguments": {"objectives": objectives}})
        if malformed is not None:
            call = MALFORMED[malformed](call)
        return "<tool_call>\n" + call + "\n</tool_call>"

    def _combine(self, response: str) -> str:
        answers = []
        for line in response.strip().splitlines():
            match = _RETURN_LINE.match(line)
            value = match.group(1) if match else line.strip()
            if not _INTEGER.fullmatch(value):
                raise ValueError(f"ChainSumTeacher: a clone returned {value!r}, not an integer")
            answers.append(int(value))
        if not answers:
            raise ValueError("ChainSumTeacher: an empty tool response")
        return self._solve(answers)


def _is_notice(response: str) -> bool:
    """Whether a tool response is the engine's error notice for a rejected call: every line
    an error (clone results carry at least one answer, or fail the root's sum)."""
    values = [_RETURN_LINE.match(line) for line in response.strip().splitlines() if line.strip()]
    return bool(values) and all(value and value.group(1).startswith("error:") for value in values)
