"""Budgets, all in tokens, and the arithmetic that enforces them at sampling time.

Generation budgets are hierarchical, so concurrent clones never race for one shared pool:
the root owns the whole tree's generation budget (its *pool*); a spawn call carves a share of
the parent's pool for each clone; a finished clone's unused tokens flow back to its parent.
Every backend call asks for ``max_tokens = min(own generation left, pool left, context
left)``, so no token is ever generated past any budget.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from selfcest.configure import ConfigError, setting


class BudgetError(ConfigError):
    """An impossible budget configuration."""


@dataclass
class Budget:
    """Every limit that applies to one clone tree (validated on construction)."""

    node_generation: int = setting(256, help="tokens one node may generate over all its turns")
    clone_generation: int = setting(0, help=(
        "tokens one clone may generate, if clones get less than the root (the paper code: root "
        "4096, clones 1024); 0 means node_generation"))
    node_context: int = setting(1024,
                                help="tokens one node's context may hold (prompt + all segments)")
    tree_generation: int = setting(2048, help="tokens all nodes of a tree may generate together "
                                              "(the matched inference budget)")
    max_depth: int = setting(1, help="deepest clone level; 0 disables spawning, 1 lets only the "
                                     "root spawn")
    clones_per_spawn: int = setting(4, help="objectives one spawn call may start; extras get an "
                                            "error entry")
    clones_per_tree: int = setting(16, help="clones one tree may hold in total")
    spawn_rounds: int = setting(2, help="spawn calls one node may make (malformed calls count too)")
    return_tokens: int = setting(32, help="tokens of one clone's answer shown to its parent")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise BudgetError(f"{f.name} must be an integer, got {value!r}")
            minimum = 0 if f.name in ("max_depth", "clones_per_tree", "spawn_rounds",
                                      "clone_generation") else 1
            if value < minimum:
                raise BudgetError(f"{f.name} must be >= {minimum}, got {value}")
        if self.node_generation > self.tree_generation:
            raise BudgetError(
                f"node_generation ({self.node_generation}) exceeds tree_generation "
                f"({self.tree_generation}): raise tree_generation or lower node_generation"
            )

    @property
    def clone_cap(self) -> int:
        """Own-generation cap of a clone before any parent request."""
        return min(self.clone_generation or self.node_generation, self.node_generation)

    @property
    def spawning(self) -> bool:
        return self.max_depth > 0 and self.spawn_rounds > 0 and self.clones_per_tree > 0


@dataclass
class Allowance:
    """The generation tokens one node may still spend.

    ``cap`` bounds the node's own generation; ``pool`` bounds its whole subtree (its own
    tokens plus every clone below it).
    """

    cap: int
    pool: int
    own: int = 0  # tokens this node generated
    descendants: int = 0  # tokens its finished clones (and theirs) generated
    lent: int = 0  # pool shares its running clones hold

    @property
    def pool_left(self) -> int:
        return self.pool - self.own - self.descendants - self.lent

    @property
    def spent(self) -> int:
        return self.own + self.descendants

    def max_tokens(self, context_length: int, node_context: int) -> int:
        """Largest generation this node may request now (0 means it must stop)."""
        return max(0, min(self.cap - self.own, self.pool_left, node_context - context_length))

    def spend(self, tokens: int) -> None:
        if tokens > min(self.cap - self.own, self.pool_left):
            raise RuntimeError("generated past a budget: the backend ignored max_tokens")
        self.own += tokens

    def lend(self, shares: list[int]) -> None:
        if sum(shares) > self.pool_left:
            raise RuntimeError("lent more than the pool holds")
        self.lent += sum(shares)

    def settle(self, share: int, child: Allowance) -> None:
        """Take back a finished clone's share, keeping what it spent as spent."""
        self.lent -= share
        self.descendants += child.spent


def clone_pools(pool_left: int, requested: list[int | None], own_left: int
                | None = None) -> list[int]:
    """Generation pools for the clones of one spawn call.

    The parent keeps a reserve for its own continuation: an equal ``1 / (k + 1)`` share of
    its remaining pool, but never more than ``own_left``, the tokens it may still generate
    itself (a reserve it could not spend would starve its clones, and theirs, for nothing).
    The ``k`` clones split the rest equally; a clone's pool is its share, lowered to the
    budget the parent requested for it when it asked for less.
    """
    k = len(requested)
    if k == 0:
        return []
    reserve = pool_left // (k + 1)
    if own_left is not None:
        reserve = min(reserve, max(0, own_left))
    share = (pool_left - reserve) // k
    return [share if r is None else min(r, share) for r in requested]


def clone_allowance(pool: int, requested: int | None, clone_cap: int) -> Allowance:
    """A clone's allowance: its own generation capped by the request and ``clone_cap``."""
    cap = clone_cap if requested is None else min(requested, clone_cap)
    return Allowance(cap=min(cap, pool), pool=pool)


def fair_shares(lengths: list[int], total: int, per_item: int) -> list[int]:
    """Token counts to keep of each item so that the kept total fits in ``total``.

    Water-filling: every item may keep up to ``per_item`` tokens; items shorter than their
    fair share give the rest to longer ones, so short answers are never cut and long ones
    share what remains equally.
    """
    keep = [0] * len(lengths)
    remaining = max(0, total)
    pending = sorted(range(len(lengths)), key=lambda i: lengths[i])
    while pending:
        share = remaining // len(pending)
        i = pending.pop(0)
        keep[i] = min(lengths[i], per_item, share)
        remaining -= keep[i]
    return keep
