"""Cost shaping: penalties on the tokens and calls a clone tree spent.

The shaped score is ``shaped = task_score - P`` with ``P = min(sum of enabled terms,
max_penalty)``, then ``max(shaped, floor)`` when a floor is set. `CostConfig` lists the
terms.

`cost_terms` returns each enabled term under ``cost/<name>``; `shape` combines them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from selfcest.tree import CloneTree


@dataclass(frozen=True)
class SaturatingPenalty:
    """``pen(t) = 0 if t <= threshold else maximum * (1 - exp(-(t - threshold) / ramp))``."""

    threshold: float  # tokens allowed free of charge (T)
    ramp: float  # tokens past T at which the penalty reaches (1 - 1/e) of its maximum
    maximum: float  # the value the penalty saturates at (M)

    def __post_init__(self) -> None:
        if self.ramp <= 0 or self.maximum < 0:
            raise ValueError(f"need ramp > 0 and maximum >= 0, got {self}")

    def __call__(self, tokens: float) -> float:
        if tokens <= self.threshold:
            return 0.0
        return self.maximum * (1.0 - math.exp(-(tokens - self.threshold) / self.ramp))


@dataclass(frozen=True)
class SpawnCallPenalty:
    """``min(cap, per_call * max(0, calls - free_calls))`` over the root's spawn calls."""

    per_call: float = 0.1  # charge per call beyond the free ones
    free_calls: int = 2  # calls that cost nothing (the reference's "- 0.2")
    cap: float | None = None  # largest total charge; None: unbounded, as the reference

    def __call__(self, calls: int) -> float:
        charge = self.per_call * max(0, calls - self.free_calls)
        return charge if self.cap is None else min(self.cap, charge)


_NESTED = {
    "root_length": SaturatingPenalty,
    "clone_length": SaturatingPenalty,
    "spawn_calls": SpawnCallPenalty,
}


@dataclass(frozen=True)
class CostConfig:
    """Which cost terms shape the reward, and how much each weighs.

    The terms (each off when its field is None or 0):

    - ``root_length``: ``pen(root generated tokens)`` with the saturating penalty
      ``pen(t; T, ramp, M) = 0 if t <= T else M * (1 - exp(-(t - T) / ramp))``
      (reference: T=512, ramp=256, M=0.3; 768 tokens cost 0.19, 1024 cost 0.26).
    - ``clone_length``: per spawn wave (one spawn call of any node; its clones run
      concurrently), ``pen(longest clone's own generated tokens in that wave)``, combined over
      waves by ``clone_waves``: ``"max"`` (the reference: only the worst wave counts, a crude
      latency proxy that ignores how many waves ran) or ``"sum"`` (every wave adds its own).
      Reference: T=512, ramp=512, M=0.2 (a 1024-token clone costs 0.126).
    - ``spawn_calls``: ``min(cap, per_call * max(0, calls - free_calls))`` for the root's spawn
      calls (reference: ``max(0, 0.1 * calls - 0.2)``, uncapped).
    - ``per_token * generated tokens of the whole tree``, ``per_processed_token * processed
      tokens`` (`TreeCosts.processed_tokens`: everything the tree held in context beyond the root's
      prompt, so clones' prompts, generations and returns all count), ``per_critical_path_token *
      critical-path tokens`` (`CloneTree.critical_path`: own tokens plus, per wave, the longest
      child's critical path) and ``per_clone * number of clones``: direct linear costs, which the
      reference lacks (it never charges for the number of clones).

    The defaults are the reference's arithmetic and long-context shaping (both length
    penalties and the spawn-call penalty, no cap, no floor). Nested terms also accept a
    mapping of their fields, as Hydra configs give them.
    """

    # Saturating penalty on the root's generated tokens; None turns it off.
    root_length: SaturatingPenalty | None = SaturatingPenalty(512, 256, 0.3)
    # Saturating penalty on the longest clone of each spawn wave; None turns it off.
    clone_length: SaturatingPenalty | None = SaturatingPenalty(512, 512, 0.2)
    # How clone_length combines waves: "max" (reference) or "sum".
    clone_waves: str = "max"
    # Penalty on the number of spawn calls the root made; None turns it off.
    spawn_calls: SpawnCallPenalty | None = SpawnCallPenalty()
    # Cost per generated token of the whole tree (root and every clone).
    per_token: float = 0.0
    # Cost per processed token: every token of every node's context but the root's prompt.
    per_processed_token: float = 0.0
    # Cost per critical-path token (the sequential latency proxy).
    per_critical_path_token: float = 0.0
    # Cost per clone started.
    per_clone: float = 0.0
    # Upper bound on the total penalty; None: unbounded (the reference math reward uses 0.5).
    max_penalty: float | None = None
    # Lower bound on the shaped score; None: none (the reference math reward uses 0).
    floor: float | None = None

    def __post_init__(self) -> None:
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, cls(**value))
        if self.clone_waves not in ("max", "sum"):
            raise ValueError(f"clone_waves must be 'max' or 'sum', got {self.clone_waves!r}")

    @classmethod
    def from_value(cls, value: CostConfig | Mapping[str, Any] | None) -> CostConfig | None:
        """A config from an instance, a mapping of its fields (Hydra), or None (no shaping)."""
        if value is None or isinstance(value, CostConfig):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise ValueError(f"unknown cost fields {sorted(unknown)}; known: {sorted(known)}")
            return cls(**value)
        raise TypeError(f"expected a CostConfig or a mapping, got {value!r}")


# The reference math reward: s - min(P_root + P_clone, 0.5), floored at 0; no call penalty.
MATH_REFERENCE_COST = CostConfig(spawn_calls=None, max_penalty=0.5, floor=0.0)
# The reference no-delegation baseline: the root-length penalty only.
NO_CLONE_REFERENCE_COST = CostConfig(clone_length=None, spawn_calls=None)


def spawn_waves(tree: CloneTree) -> list[list[str]]:
    """Child ids of every spawn call in the tree that started at least one clone."""
    return [
        list(spawn.child_ids)
        for node in tree.nodes.values()
        for spawn in node.spawns
        if spawn.child_ids
    ]


def cost_terms(tree: CloneTree, config: CostConfig) -> dict[str, float]:
    """Each enabled penalty term of ``tree``, keyed ``cost/<term>`` (`CostConfig`)."""
    terms: dict[str, float] = {}
    if config.root_length is not None:
        terms["cost/root_length"] = config.root_length(tree.root.generated_tokens)
    if config.clone_length is not None:
        per_wave = [
            config.clone_length(max(tree.nodes[c].generated_tokens for c in wave))
            for wave in spawn_waves(tree)
        ]
        terms["cost/clone_length"] = (
            max(per_wave, default=0.0) if config.clone_waves == "max" else float(sum(per_wave))
        )
    if config.spawn_calls is not None:
        terms["cost/spawn_calls"] = config.spawn_calls(len(tree.root.spawns))
    costs = None
    if (config.per_token or config.per_processed_token or config.per_critical_path_token
            or config.per_clone):
        costs = tree.costs()
    if config.per_token:
        terms["cost/tokens"] = config.per_token * costs.generated_tokens
    if config.per_processed_token:
        terms["cost/processed_tokens"] = config.per_processed_token * costs.processed_tokens
    if config.per_critical_path_token:
        terms["cost/critical_path"] = config.per_critical_path_token * costs.critical_path_tokens
    if config.per_clone:
        terms["cost/clones"] = config.per_clone * costs.clones
    return terms


def shape(task_score: float, terms: Mapping[str, float], config: CostConfig) -> tuple[float, float]:
    """(shaped score, total penalty): ``max(floor, task_score - min(sum(terms), max_penalty))``."""
    penalty = sum(terms.values())
    if config.max_penalty is not None:
        penalty = min(penalty, config.max_penalty)
    score = task_score - penalty
    if config.floor is not None:
        score = max(config.floor, score)
    return score, penalty
