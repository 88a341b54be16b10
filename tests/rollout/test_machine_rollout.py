"""Placement of processes on nodes, and what a process without an engine does. (Several
processes sharing one engine run in test_distributed.py.)"""

import asyncio

import pytest

from selfcest.configure import ConfigError
from selfcest.rollout.machine_rollout import FollowerBackend, Placement, rollout_on_machine
from selfcest.task import Task
from selfcest.train.config import TrainConfig, validate
from selfcest.tree import CloneTree


def test_nodes_are_contiguous_blocks_of_ranks():
    nodes = [Placement.of(rank, 16, per_node=8) for rank in range(16)]
    assert [n.leader for n in nodes] == [0] * 8 + [8] * 8
    assert [n.rank for n in nodes if n.is_leader] == [0, 8]
    assert [nodes[0].owner(i) for i in (0, 5, 16, 17)] == [0, 5, 0, 1]
    assert nodes[3].on_my_node(7) and not nodes[3].on_my_node(8) and nodes[9].on_my_node(15)


def test_uneven_nodes_are_refused():
    with pytest.raises(ConfigError, match="same number of processes on every node"):
        Placement.of(0, 12, per_node=8)


def test_alone_the_leader_rolls_out_every_prompt_in_order():
    tasks = [Task(id=f"t{i}", prompt=f"p{i}", answer="0") for i in range(3)]
    seen = []

    def rollout(mine):
        seen.append([t.id for t in mine])
        return [CloneTree(t.id, i, sample) for i, t in enumerate(mine) for sample in range(2)]

    trees = rollout_on_machine(Placement.of(0, 1), tasks, 2, rollout)
    assert seen == [["t0", "t1", "t2"]]
    assert [t.task_id for t in trees] == ["t0", "t0", "t1", "t1", "t2", "t2"]


def test_a_follower_cannot_generate():
    with pytest.raises(RuntimeError, match="engine_per_node"):
        asyncio.run(FollowerBackend().generate([1], max_tokens=1))


def test_counterfactual_credit_needs_an_engine_in_every_process():
    config = TrainConfig()
    config.rollout.engine_per_node = True
    config.algo.credit.strategy = "counterfactual"
    with pytest.raises(ConfigError, match="rollout.engine_per_node"):
        validate(config)
