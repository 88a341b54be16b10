"""SFT on protocol traces: the loss is on the model's own turns only, and it learns them."""

from __future__ import annotations

import pytest
import torch

from selfcest.budget import Budget
from selfcest.configure import ConfigError
from selfcest.policy import ClonePolicy
from selfcest.protocol import TokenProtocol
from selfcest.rollout.backends.base import SamplingParams
from selfcest.tasks.keyed_sum import KeyedSumConfig, keyed_sum_tasks
from selfcest.tasks.keyed_sum_teacher import KeyedSumTeacher
from selfcest.train.config import TaskSourceConfig, TrainConfig
from selfcest.train.setup import held_out_tasks, run_warm_start, warm_start_trees
from selfcest.train.sft import SFTConfig, sft_samples, train_sft
from selfcest.train.traces import teacher_trees

BUDGET = Budget(node_generation=128, tree_generation=1024, node_context=512, max_depth=2)


def demo_trees(policy, n=4, seed=0):
    tasks = keyed_sum_tasks(n, seed=seed,
                            config=KeyedSumConfig(num_keys=2, list_len=2, max_value=3))
    return tasks, teacher_trees(tasks, KeyedSumTeacher(redelegate=0.0), policy.protocol, BUDGET)


def test_masks_cover_exactly_the_sampled_tokens(tiny_policy):
    _, trees = demo_trees(tiny_policy)
    samples = sft_samples(trees)
    assert len(samples) == sum(len(t.nodes) for t in trees)
    tree = trees[0]
    root = next(s for s in samples if s.node_id == "0" and s.tree_id == 0)
    expected = [0] * len(tree.root.prompt_ids)
    for segment in tree.root.segments:
        expected += [int(segment.trainable)] * len(segment.token_ids)
    assert root.loss_mask == expected and 0 < sum(expected) < len(expected)


def test_sft_learns_the_demonstrations(tmp_path):
    torch.manual_seed(0)
    policy = ClonePolicy.build_tiny(seed=5)
    tasks, trees = demo_trees(policy, n=3, seed=7)
    # Greedy decoding must follow what was learned on any CPU: 120 steps left one digit ahead
    # of the next by a logit gap of 0.09 (float kernels moved it by 0.02); 200 leave >= 4.
    history = train_sft(policy, trees,
                        SFTConfig(steps=200, sequences_per_step=9, lr=1e-2, warmup_steps=5))
    assert history[-1]["sft/loss"] < 0.1 * history[0]["sft/loss"]
    engine = policy.engine(BUDGET, SamplingParams(temperature=0))
    for task, tree in zip(tasks, engine.rollout(tasks)):
        assert tree.answer == task.answer and tree.costs().clones == 2  # it delegates, correctly


def test_returned_tokens_are_never_targets():
    """Whatever a return says, the loss is the same function of the model's own tokens:
    perturbing a returned token changes no target of the loss."""
    policy = ClonePolicy.build_tiny(seed=6)
    _, trees = demo_trees(policy, n=1, seed=3)
    (root,) = [s for s in sft_samples(trees) if s.node_id == "0"]
    tree = trees[0]
    start = len(tree.root.prompt_ids) + len(tree.root.segments[0].token_ids)
    returned = range(start, start + len(tree.root.segments[1].token_ids))
    assert tree.root.segments[1].kind == "return"
    assert all(root.loss_mask[i] == 0 for i in returned)
    assert all(root.loss_mask[i] == 1
               for i in range(start - len(tree.root.segments[0].token_ids), start))


def test_the_sft_entry_point_leaves_held_out_tasks_out_and_saves_a_loadable_policy(tmp_path):
    config = TrainConfig()
    shape = {"num_keys": 2, "list_len": 2, "max_value": 3}
    config.task.params = {"split": "train", "n_train": 16, "n_test": 8, "n_ood": 0, "train": shape}
    config.task.eval_params = {"split": "test"}
    config.warm_start.tasks = {"name": "keyed_sum", "params": {**config.task.params, "n_train": 24}}
    config.warm_start.teacher_params = {"redelegate": 0.0}
    config.warm_start.sft = SFTConfig(steps=3, sequences_per_step=4)
    config.rollout.budget = BUDGET
    config.trainer.output_dir = str(tmp_path)
    held_out = held_out_tasks(config)
    assert len(held_out) == 8  # the test split (task.eval_params); no OOD split configured
    out = run_warm_start(config)
    assert len((out / "sft.jsonl").read_text().splitlines()) == 3
    assert isinstance(ClonePolicy.from_pretrained(out).protocol, TokenProtocol)
    config.warm_start.tasks = None
    with pytest.raises(ConfigError, match="warm_start.tasks"):
        run_warm_start(config)


def test_direct_tasks_are_demonstrated_as_a_monolithic_root_sees_them():
    """warm_start.direct_tasks: the same teacher, spawning off, so a tool-call root is shown
    no tool and solves directly; the tool-offered tasks still delegate."""
    pytest.importorskip("reasoning_gym")
    policy = ClonePolicy.build_tiny(seed=0, protocol="tool")
    config = TrainConfig()
    shape = {"dataset": "chain_sum", "split": "train", "min_terms": 4, "max_terms": 4,
             "min_digits": 1, "max_digits": 1}
    config.warm_start.teacher = "chain_sum"
    config.warm_start.teacher_params = {"delegate": 1.0}
    config.warm_start.tasks = TaskSourceConfig("gym", {**shape, "size": 6, "seed": 10})
    config.warm_start.direct_tasks = TaskSourceConfig("gym", {**shape, "size": 4, "seed": 20})
    config.rollout.budget = Budget(node_generation=160, node_context=1024, tree_generation=512,
                                   max_depth=1,
                                   clones_per_spawn=2, clones_per_tree=2, spawn_rounds=1)
    trees = warm_start_trees(config, policy.protocol)
    shown_tool = ["spawn_clone" in policy.protocol.decode(t.root.prompt_ids) for t in trees]
    delegated = [bool(t.root.children) for t in trees]
    assert shown_tool == delegated == [True] * 6 + [False] * 4


def test_a_rejected_call_is_context_and_its_repair_a_target():
    """In a repair demonstration (ChainSumTeacher(repair=1.0)) the malformed call, which the
    engine answered with a notice, gets no loss; the repaired call and the final sum do."""
    pytest.importorskip("reasoning_gym")
    from selfcest.tasks import load_tasks
    from selfcest.tasks.chain_sum_teacher import ChainSumTeacher

    policy = ClonePolicy.build_tiny(seed=0, protocol="tool")
    tasks = load_tasks("gym", dataset="chain_sum", size=2, seed=4, min_terms=3, max_terms=4,
                       min_digits=1, max_digits=1)
    budget = Budget(node_generation=160, node_context=1024, tree_generation=512, max_depth=1,
                    clones_per_spawn=2, clones_per_tree=2, spawn_rounds=2)
    trees = teacher_trees(tasks, ChainSumTeacher(delegate=1.0, repair=1.0), policy.protocol, budget)
    root = next(s for s in sft_samples(trees) if s.node_id == "0" and s.tree_id == 0)
    segments = trees[0].root.segments
    assert [s.kind for s in segments] == ["sampled", "notice", "sampled", "return", "sampled"]
    expected = [0] * len(trees[0].root.prompt_ids)
    for segment, trained in zip(segments, [0, 0, 1, 0, 1]):
        expected += [trained] * len(segment.token_ids)
    assert root.loss_mask == expected


@pytest.mark.parametrize("target, steps_run, best_check", [(1.0, 6, 1), (0.8, 4, 1)])
def test_validation_keeps_the_best_weights_and_stops_at_the_target(target, steps_run, best_check):
    """Scores 0.2, 0.9, 0.5 at steps 2, 4, 6: the weights of step 4 are kept; with a target of
    0.8 training stops there."""
    policy = ClonePolicy.build_tiny(seed=2)
    _, trees = demo_trees(policy)
    scores, seen = iter([0.2, 0.9, 0.5]), []

    def score(policy):
        seen.append({k: v.clone() for k, v in policy.model.state_dict().items()})
        return next(scores)

    config = SFTConfig(steps=6, sequences_per_step=4, lr=1e-2, warmup_steps=0, validate_every=2,
                       validation_target=target)
    history = train_sft(policy, trees, config, score=score)
    assert len(history) == steps_run
    assert [h.get("sft/validation") for h in history][1::2] == [0.2, 0.9, 0.5][: steps_run // 2]
    kept = policy.model.state_dict()
    assert all(torch.equal(kept[k], seen[best_check][k]) for k in kept)
    assert not all(torch.equal(kept[k], seen[0][k]) for k in kept)  # the weights did move
