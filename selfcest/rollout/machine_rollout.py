"""One rollout engine per machine, serving every training process on it ("node" below and in
``rollout.engine_per_node`` is a machine of the cluster, never a tree's node).

With ``rollout.engine_per_node``, the first process of each node (its leader) expands the
trees of all the node's prompts; every tree is then sent to the process that owns its
prompt, which scores it and trains on it as usual.

Ownership is the same as without a shared engine: prompt ``i`` of a step belongs to
process ``i % world_size``, with its whole group of trees, and on one node the leader's trees
are those one process would sample for the whole step with the same seed.

Simplifications, stated: processes sit on nodes in contiguous blocks of equal size (what
``torchrun`` and ``accelerate launch`` do); counterfactual credit is not supported with a
shared engine (its re-runs would need an engine in every process).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from selfcest.configure import ConfigError
from selfcest.task import Task
from selfcest.tree import CloneTree


@dataclass(frozen=True)
class Placement:
    """Where this process sits: its rank, and the block of ranks on its node."""

    rank: int
    world_size: int
    per_node: int  # processes on every node

    @classmethod
    def of(cls, rank: int, world_size: int, per_node: int | None = None) -> Placement:
        """This process's node; ``per_node`` defaults to the launcher's ``LOCAL_WORLD_SIZE``."""
        per_node = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size % per_node:
            raise ConfigError(
                f"rollout.engine_per_node needs the same number of processes on every node; "
                f"got {world_size} processes with {per_node} on this node"
            )
        return cls(rank, world_size, per_node)

    @property
    def leader(self) -> int:
        return self.rank - self.rank % self.per_node

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def on_my_node(self, rank: int) -> bool:
        return rank // self.per_node == self.rank // self.per_node

    def owner(self, prompt_index: int) -> int:
        """The process that trains on the step's prompt ``prompt_index``."""
        return prompt_index % self.world_size


def rollout_on_machine(
    placement: Placement,
    tasks: Sequence[Task],
    samples_per_task: int,
    rollout: Callable[[list[Task]], list[CloneTree]],
    backend=None,
) -> list[CloneTree]:
    """This process's trees for its prompts of the step's ``tasks`` (every process calls).

    On a leader, ``rollout(node_tasks)`` expands the node's prompts, in the step's order,
    returning ``samples_per_task`` trees per task grouped by task (as
    `RolloutEngine.rollout` does), within ``backend.leading()`` where it has one; other
    processes never call it and run ``backend.follow()`` instead, where it has one.
    """
    # With the hf backend only the leader builds an engine; the others (`FollowerBackend`) wait
    # while it rolls out. With vLLM the engine is one tensor-parallel engine over the node's
    # processes (rollout.vllm.tensor_parallel_size = processes per node), colocated with the
    # trainers instead of one whole model per GPU: every process holds its shard and loads its
    # weights in memory, and while the leader drives the rollout (inside ``leading``) the
    # others replay its engine's steps (``follow``). The leader expands the node's prompts in
    # the step's order, so the trees are those one process would sample with the same seed.
    share: list[list[CloneTree]] | None = None
    if placement.is_leader:
        on_node = [i for i in range(len(tasks)) if placement.on_my_node(placement.owner(i))]
        with getattr(backend, "leading", contextlib.nullcontext)():
            trees = rollout([tasks[i] for i in on_node])
        share = [[] for _ in range(placement.world_size)]
        for position, index in enumerate(on_node):
            group = trees[position * samples_per_task : (position + 1) * samples_per_task]
            share[placement.owner(index)].extend(group)
    else:
        getattr(backend, "follow", lambda: None)()
    if placement.world_size == 1:
        return share[0]
    mine: list[CloneTree] = []
    for leader in range(0, placement.world_size, placement.per_node):
        received: list = [None]
        dist.scatter_object_list(received, share if placement.rank == leader else None, src=leader)
        if leader == placement.leader:
            mine = received[0]
    return mine


class FollowerBackend:
    """The backend of a process whose rollouts its node's leader serves: no engine.

    ``weight_version`` is the leader's, set by the trainer after every sync, so this process's
    stale-sample checks compare against the weights its trees were really sampled under."""

    def __init__(self, weight_version: int = 0) -> None:
        self.weight_version = weight_version

    async def generate(self, *args, **kwargs):
        raise RuntimeError(
            "this process has no engine: with rollout.engine_per_node its node's first "
            "process generates for it"
        )

    def sync_weights(self, model=None) -> None:
        """Nothing to load: the leader's engine serves the node."""

    def sleep(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to release."""
