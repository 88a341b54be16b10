"""GRPOTrainer end to end on tiny models: parameters move, masks hold, credit reaches
clones, resume is exact."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import DEMO_CONTEXT, overfit
from safetensors.torch import load_file

from selfcest.algo.advantages import Advantages, compute_advantages
from selfcest.budget import Budget
from selfcest.configure import ConfigError, RunError
from selfcest.modeling import forward_logprobs
from selfcest.policy import ClonePolicy, LoraSettings, build_tokenizer
from selfcest.protocol import SpawnRequest
from selfcest.rewards.base import RewardResult, load_reward, progress_summary, score_trees
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.scripted import ScriptedBackend
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task
from selfcest.train import trainer as trainer_module
from selfcest.train.batching import (
    make_micro_batches,
    packed_micro_batches,
    packing_width,
    padding_fraction,
    samples_from_trees,
)
from selfcest.train.checkpoint import list_checkpoints
from selfcest.train.config import TrainConfig
from selfcest.train.counterfactual import counterfactual_reruns
from selfcest.train.logging import PhaseTimer, read_metrics
from selfcest.train.setup import build_policy, build_trainer
from selfcest.train.trainer import GRPOTrainer

DIGIT_REWARD = textwrap.dedent(
    """
    from selfcest.rewards.base import RewardResult

    def reward(tree, task):
        # Share of digits in everything the tree generated: varies a lot under a random
        # policy, so every group has variance and every step trains.
        text = "".join(n.text() for n in tree.nodes.values())
        return RewardResult(score=sum(c.isdigit() for c in text) / max(1, len(text)),
                            correct=tree.answer == task.answer)
    """
)


def small_config(tmp_path, **trainer) -> TrainConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    reward_file = tmp_path / "digit_reward.py"
    reward_file.write_text(DIGIT_REWARD)
    config = TrainConfig()
    config.task.reward = f"{reward_file}:reward"
    config.task.params = {"split": "train", "n_train": 64, "n_test": 8, "n_ood": 8}
    config.rollout.budget = Budget(node_generation=24, tree_generation=64, node_context=256)
    config.trainer.tokens_per_micro_batch = 2048
    config.trainer.prompts_per_step = 4
    config.trainer.output_dir = str(tmp_path / "run")
    config.log.progress = False
    for key, value in trainer.items():
        setattr(config.trainer, key, value)
    return config


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_two_steps_change_every_trainable_parameter(tmp_path):
    trainer = build_trainer(small_config(tmp_path, steps=2, lr=1e-2))
    before = params_of(trainer.policy.model)
    history = trainer.train()
    trainer.close()
    after = params_of(trainer.policy.model)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters that did not move: {unchanged}"
    assert len(history) == 2 and all(h["train/optimizer_steps"] == 1 for h in history)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "model.safetensors").exists()


@pytest.mark.slow  # sampled trees: the margin, not the values, holds on every machine
def test_a_few_steps_raise_the_reward_they_are_trained_on(tmp_path):
    """The direction check end to end: GRPO on the digit-share reward raises the digit share
    of fresh samples (a flipped advantage sign lowers it). What is sampled follows the CPU's
    float kernels; over trainer seeds 0-7 the share rose 3.7-6.7x (6.7-7.6x at seed 0 under
    the default, avx2 and no-SIMD kernels), so 2x holds with room. The machine-independent
    check: test_one_update_makes_what_was_rewarded_likelier."""
    trainer = build_trainer(small_config(tmp_path, steps=6, lr=1e-2, trees_per_prompt=8))
    tasks = trainer.train_tasks[:8]

    def digit_share() -> float:
        trees = trainer.engine(seed=99).rollout(tasks, 8)
        return statistics.fmean(trainer.reward_fn(t, tasks[t.task_index]).score for t in trees)

    before = digit_share()
    trainer.train()
    trainer.close()
    after = digit_share()
    assert after > 2 * before, (before, after)


def turn_logprob(model, prompt: list[int], text_ids: list[int]) -> float:
    ids = torch.tensor([prompt + text_ids])
    with torch.no_grad():
        return forward_logprobs(model, ids, torch.ones_like(ids))[0][0, len(prompt):].sum().item()


@pytest.mark.parametrize("judged", ["root", "clone"])
def test_one_update_makes_what_was_rewarded_likelier(tmp_path, tiny_policy, demo_task, judged):
    """One update on test-written trees: a tree is rewarded for its root's answer (10, not
    9), or for its L2 clone's (7, not 5: credit must reach clones). Afterwards the rewarded
    turn has gained on the other by far more than float rounding could move them: one AdamW
    step at lr 1e-2 moves the gap by 1.5 (clone) to 3 nats (root); both turns share most
    tokens, so each alone may rise or fall; kernels differ by about 1e-5."""
    good, bad = ("Answer: 10", "Answer: 9") if judged == "root" else ("Answer: 7", "Answer: 5")
    turn = itertools.count()

    def respond(prompt: str) -> str:
        if judged == "root":
            return [good, bad][next(turn) % 2]
        if "</return>" in prompt.rsplit("<|im_start|>assistant\n", 1)[1]:
            return "Answer: 10"
        if "[L2]" in prompt:
            return [good, bad][next(turn) % 2]
        return "Answer: 3" if "[L1]" in prompt else "<spawn>sum @L1<sep>sum @L2</spawn>"

    policy = ClonePolicy(copy.deepcopy(tiny_policy.model), tiny_policy.tokenizer,
                         tiny_policy.protocol)
    trees = scripted_trees(policy, [demo_task], respond)
    for tree in trees:
        node = (tree.root if judged == "root"
                else next(c for c in tree.clones() if c.objective == "sum @L2"))
        tree.reward = float(node.answer == good.split()[-1])
        tree.correct, tree.info["malformed_nodes"] = False, []
    assert sorted(t.reward for t in trees) == [0.0, 0.0, 1.0, 1.0]
    protocol, enc = policy.protocol, policy.protocol.encode
    prompt = (protocol.root_prompt(demo_task) if judged == "root"
              else protocol.clone_prompt(SpawnRequest("sum @L2", ("L2",)), DEMO_CONTEXT))
    before = {text: turn_logprob(policy.model, prompt, enc(text + "<|im_end|>"))
              for text in (good, bad)}
    trainer = build_trainer(small_config(tmp_path, lr=1e-2), policy=policy, train_tasks=[demo_task])
    assert trainer.train_on_trees(trees)["train/optimizer_steps"] == 1
    trainer.close()
    after = {text: turn_logprob(policy.model, prompt, enc(text + "<|im_end|>"))
             for text in (good, bad)}
    gain = (after[good] - after[bad]) - (before[good] - before[bad])
    assert gain > 0.5, (before, after)


def test_same_seed_same_run_whatever_ran_before(tmp_path):
    """Two runs of one config are bitwise identical, even when the process drew different
    random numbers before them (dropout draws from the global RNG, which the trainer seeds)."""

    def final_weights(folder, draws):
        config = small_config(tmp_path / folder, steps=2, lr=1e-2)
        policy = dropout_policy(config)
        torch.rand(draws)
        random.random()
        trainer = build_trainer(config, policy=policy)
        trainer.train()
        trainer.close()
        return params_of(trainer.policy.model)

    first, second = final_weights("a", 1), final_weights("b", 1000)
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_injected_and_prompt_tokens_get_exactly_zero_gradient(spawning_policy, demo_task, tmp_path):
    """The loss never pulls on the prediction of a token the node did not sample."""
    policy = ClonePolicy(spawning_policy.model, spawning_policy.tokenizer, spawning_policy.protocol)
    trainer = build_trainer(small_config(tmp_path), policy=policy, train_tasks=[demo_task])
    (tree,) = policy.engine(Budget(max_depth=1), SamplingParams(temperature=0)).rollout([demo_task])
    assert any(s.kind == "return" for s in tree.root.segments)
    (sample,) = [s for s in samples_from_trees(
        [tree], Advantages([{n: 1.0 for n in tree.nodes}], [True], {}))
                 if s.node_id == "0"]
    captured = {}

    def keep_logits(module, inputs, logits):
        logits.retain_grad()
        captured["logits"] = logits

    hook = policy.model.get_output_embeddings().register_forward_hook(keep_logits)
    try:
        trainer._backward([sample], [1.0], None, None, PhaseTimer("cpu"))
    finally:
        hook.remove()
        policy.model.zero_grad(set_to_none=True)
    # Row t of the logits predicts token t + 1; rows before the first sampled token's are
    # never computed (logits_to_keep).
    grad = captured["logits"].grad[0]
    skipped = len(sample.loss_mask) - grad.shape[0]
    assert skipped == sample.loss_mask.index(1) - 1
    predicts_sampled = torch.tensor((sample.loss_mask[1:] + [0])[skipped:], dtype=torch.bool)
    assert grad[~predicts_sampled].abs().max() == 0  # prompt, return and padding: exactly zero
    assert (grad[predicts_sampled].abs().sum(-1) > 0).all()


@pytest.mark.slow  # sampled trees and trained weights: the margin holds, the values move
def test_credit_reaches_clones(tmp_path):
    """A reward that depends only on what clones answer changes what clones answer, end to
    end over 20 sampled steps (test_one_update_makes_what_was_rewarded_likelier checks the
    same direction on test-written trees, on any machine)."""
    policy = ClonePolicy.build_tiny(seed=2)
    task = Task("pick", "Add all numbers in L1 L2.", "?", DEMO_CONTEXT)
    p, enc = policy.protocol, policy.protocol.encode
    traces = [(p.root_prompt(task), [("sampled", enc("<spawn>sum @L1<sep>sum @L2</spawn>")),
                                     ("return", enc("<return>3<sep>7</return>")),
                                     ("sampled", enc("Answer: 10<|im_end|>"))])]
    for key in ("L1", "L2"):
        prompt = p.clone_prompt(SpawnRequest(f"sum @{key}", (key,)), DEMO_CONTEXT)
        traces += [(prompt, [("sampled", enc(f"Answer: {d}<|im_end|>"))]) for d in "3579"]
    overfit(policy, traces, steps=120)

    def sevens(trees):
        answers = [t.nodes[c].answer for t in trees for c in t.root.children]
        return sum(a == "7" for a in answers) / max(1, len(answers))

    def clone_reward(tree, _task):
        return RewardResult(score=sevens([tree]), correct=False)

    probe = policy.engine(Budget(max_depth=1), SamplingParams(), seed=123)
    before = sevens(probe.rollout([task], samples_per_task=64))
    # lr 3e-3 over 12 steps collapsed the root's spawn calls for 2 of 3 init seeds (then no
    # tree has clones and every group ties); 1e-3 over 20 steps lifts 0.22-0.30 to 0.89-0.95.
    config = small_config(tmp_path, steps=20, lr=1e-3, trees_per_prompt=8, prompts_per_step=2)
    config.rollout.budget = Budget(max_depth=1)
    trainer = build_trainer(config, policy=policy, train_tasks=[task], reward_fn=clone_reward)
    trainer.train()
    trainer.close()
    after = sevens(probe.rollout([task], samples_per_task=64))
    assert 0.1 < before < 0.45  # the warm start answers 3, 5, 7 or 9 about evenly
    assert after > before + 0.3, (before, after)


def dropout_policy(config: TrainConfig) -> ClonePolicy:
    """The config's policy with attention dropout: training then draws from torch's global
    RNG, so a resume that loses the RNG state trains other weights."""
    policy = build_policy(config)
    for module in policy.model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    return policy


def next_step_tokens(trainer: GRPOTrainer) -> list[list[int]]:
    """The tokens the step after the last one would sample (its tasks, its seed)."""
    tasks = trainer.sampler.take(trainer.config.trainer.prompts_per_step)
    trees = trainer.engine(trainer._step_seed(trainer.state.step)).rollout(tasks, 2)
    return [node.context_ids() for tree in trees for node in tree.nodes.values()]


def test_resume_is_bitwise_exact(tmp_path):
    """A 4-step run under a warmed-up cosine schedule and dropout, killed after its step-2
    checkpoint and resumed, equals the straight run: every parameter, all optimizer and
    scheduler state, the LR of every step, the weight version and what the next step
    samples."""

    def trainer_for(folder, resume=False):
        config = small_config(tmp_path / folder, steps=4, save_every=2, resume=resume,
                              schedule="cosine", warmup_steps=1, lr=1e-2)
        # Lists printed in the prompt: every task reads differently, so the task order
        # (the sampler's resumed position) shows in what is sampled.
        config.task.params["train"] = {"inline": True}
        return build_trainer(config, policy=dropout_policy(config))

    straight = trainer_for("a")
    straight_history = straight.train()
    straight.close()
    first = trainer_for("b")
    for _ in range(2):  # what train() runs before the crash: two steps, the checkpoint
        first.step()
    first.save()
    first.close()
    resumed = trainer_for("b", resume=True)
    resumed_history = resumed.train()
    resumed.close()
    assert resumed.resumed_from.name == "step_000002" and len(resumed_history) == 2

    a, b = params_of(straight.policy.model), params_of(resumed.policy.model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], params_of(first.policy.model)[n]) for n in a)
    sa, sb = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    def plain(groups):  # a loaded state dict holds betas as a list, the live one as a tuple
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]

    assert plain(sa["param_groups"]) == plain(sb["param_groups"])
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        assert state.keys() == sb["state"][key].keys()
        assert all(torch.equal(value, sb["state"][key][name]) for name, value in state.items())
    assert straight.scheduler.state_dict() == resumed.scheduler.state_dict()
    lrs = [h["lr"] for h in straight_history]
    assert len(set(lrs)) == 4 and [h["lr"] for h in resumed_history] == lrs[2:]
    assert resumed.backend.weight_version == straight.backend.weight_version == 4
    assert next_step_tokens(resumed) == next_step_tokens(straight)


def test_stale_samples_are_refused(tmp_path, spawning_policy, demo_task):
    policy = ClonePolicy(spawning_policy.model, spawning_policy.tokenizer, spawning_policy.protocol)
    trainer = build_trainer(small_config(tmp_path), policy=policy, train_tasks=[demo_task])
    trees = policy.engine(Budget(max_depth=1),
                          SamplingParams()).rollout([demo_task], samples_per_task=4)
    for i, tree in enumerate(trees):
        tree.reward, tree.correct, tree.info["malformed_nodes"] = float(i), False, []
    trainer.backend.sync_weights(policy.model)  # the trees are now one version behind
    before = params_of(policy.model)
    metrics = trainer.train_on_trees(trees)
    assert metrics["samples/stale_refused"] == sum(len(t.nodes) for t in trees)
    assert metrics["train/optimizer_steps"] == 0
    assert all(torch.equal(before[n], p) for n, p in policy.model.named_parameters())


def test_kept_stale_samples_get_the_truncated_importance_weight(
    tmp_path, spawning_policy, demo_task):
    """stale_samples=correct keeps samples drawn under older weights and weighs them by
    min(pi_old / pi_behaviour, C), with pi_old recomputed under the current weights."""
    policy = ClonePolicy(spawning_policy.model, spawning_policy.tokenizer, spawning_policy.protocol)
    config = small_config(tmp_path)
    config.algo.stale_samples = "correct"
    trainer = build_trainer(config, policy=policy, train_tasks=[demo_task])
    trees = policy.engine(Budget(max_depth=1),
                          SamplingParams()).rollout([demo_task], samples_per_task=4)
    for i, tree in enumerate(trees):
        tree.reward, tree.correct, tree.info["malformed_nodes"] = float(i), False, []
        for node in tree.nodes.values():  # as if sampled by other weights: logprobs differ
            for segment in node.segments:
                if segment.trainable:
                    segment.logprobs = [lp - 1.0 for lp in segment.logprobs]
    trainer.backend.sync_weights(policy.model)  # the trees are now one version behind
    metrics = trainer.train_on_trees(trees)
    assert metrics["samples/stale_refused"] == 0 and metrics["train/optimizer_steps"] == 1
    # exp(old - behaviour) = e^1 > C = 2: every weight is truncated to C
    assert metrics["loss/importance_truncated_frac"] == 1.0
    assert metrics["loss/importance_weight_mean"] == pytest.approx(2.0)


def test_reward_diagnostics_reach_the_metrics(tmp_path):
    """A run whose answers are all missing logs an answer-missing rate of 1.0."""
    config = small_config(tmp_path, steps=1)
    config.task.reward = "selfcest.rewards.arithmetic:arithmetic_reward"
    config.task.reward_params = {"cost": None}
    policy = build_policy(config)
    backend = ScriptedBackend(policy.tokenizer, lambda prompt: "I would rather not say.")
    trainer = build_trainer(config, policy=policy, backend=backend)
    (metrics,) = trainer.train()
    trainer.close()
    (logged,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert logged["reward/answer_missing"] == 1.0 == metrics["reward/answer_missing"]
    assert logged["reward/task_score"] == 0.0
    assert progress_summary(metrics)["missing"] == "1.00"


def test_counterfactual_credit_measures_each_clone(tmp_path, spawning_policy, demo_task):
    """Each depth-1 clone gets the mean reward of re-runs without its answer; with the
    spawning policy, losing either clone's answer breaks the sum, so both matter."""
    policy = ClonePolicy(spawning_policy.model, spawning_policy.tokenizer, spawning_policy.protocol)
    config = small_config(tmp_path, steps=1)
    config.algo.credit.strategy = "counterfactual"
    config.algo.credit.counterfactual_samples = 2
    config.rollout.budget = Budget(max_depth=1)
    config.rollout.temperature = 0.0

    def exact(tree, task):
        return RewardResult(score=float(tree.answer == task.answer),
                            correct=tree.answer == task.answer)

    trainer = build_trainer(config, policy=policy, train_tasks=[demo_task], reward_fn=exact)
    trees = trainer.engine(seed=0).rollout([demo_task], samples_per_task=2)
    score_trees(trees, [demo_task], exact)
    counterfactual_reruns(trees, {demo_task.id: demo_task}, trainer.engine(seed=1), exact,
                          config.algo.credit)
    for tree in trees:
        assert tree.reward == 1.0
        assert set(tree.info["counterfactual"]) == {"0.0", "0.1"}
        assert all(value < 1.0 for value in tree.info["counterfactual"].values())
    trainer.close()


def test_a_lora_run_trains_every_adapter_and_the_protocol_token_embeddings(tmp_path):
    config = small_config(tmp_path, steps=2, lr=1e-2)
    config.model.lora = LoraSettings(r=4, alpha=8)
    trainer = build_trainer(config)
    before = params_of(trainer.policy.model)
    trainable = {n for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
    trainer.train()
    trainer.close()
    after = params_of(trainer.policy.model)
    assert any("trainable_tokens_delta" in n for n in trainable)
    assert not [n for n in trainable if torch.equal(before[n], after[n])]
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)


def one_update(config, spawning_policy, trees, tasks, hook=None):
    """The metrics of one update on ``trees`` from a copy of ``spawning_policy``, and the
    gradients the optimizer is handed (Adam's first step is about sign(g) * lr, so the updated
    weights would magnify float noise on near-zero gradients). ``hook``: a forward pre-hook
    (with kwargs) on the policy model."""
    policy = ClonePolicy(copy.deepcopy(spawning_policy.model), spawning_policy.tokenizer,
                         spawning_policy.protocol)
    if hook is not None:
        policy.model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer = build_trainer(config, policy=policy, train_tasks=tasks)
    gradients, step = {}, trainer.optimizer.step

    def record_gradients(*args, **kwargs):
        gradients.update({n: p.grad.clone() for n, p in policy.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = record_gradients
    metrics = trainer.train_on_trees(trees)
    trainer.close()
    return metrics, gradients


def assert_same_update(first, second) -> None:
    (metrics, gradients), (other_metrics, other_gradients) = first, second
    for key in ("loss/kl_ref", "loss/pg_loss"):
        assert other_metrics[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-7), key
    # Tolerance from the largest gradient of all: the keys' bias gets only float noise
    # (softmax ignores a shift shared by all keys), which no relative tolerance can match.
    scale = max(grad.abs().max() for grad in gradients.values())
    for name, grad in gradients.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(other_gradients[name], grad, rtol=1e-4, atol=1e-6 * scale), name


def scored(trees: list) -> list:
    """``trees`` with rewards 0, 1, 2, 3 in each group of four."""
    for i, tree in enumerate(trees):
        tree.reward, tree.correct, tree.info["malformed_nodes"] = float(i % 4), False, []
    return trees


def scripted_trees(policy: ClonePolicy, tasks, respond, per_task: int = 4) -> list:
    """Trees whose every turn the test writes (``respond(prompt text)``), each sampled token
    given its logprob under ``policy``'s model as a real backend records it. Their lengths,
    hence micro-batches and padding, are the same on every machine (sampled trees' are not:
    their tokens follow the CPU's float kernels)."""
    backend = ScriptedBackend(policy.tokenizer, respond)
    engine = RolloutEngine(backend, policy.protocol, Budget(max_depth=1, node_generation=16),
                           SamplingParams())
    trees = engine.rollout(tasks, per_task)
    with torch.no_grad():
        for node in (node for tree in trees for node in tree.nodes.values()):
            ids = torch.tensor([node.context_ids()])
            logp = forward_logprobs(policy.model, ids, torch.ones_like(ids))[0][0].tolist()
            start = len(node.prompt_ids)
            for segment in node.segments:
                if segment.trainable:
                    segment.logprobs = logp[start : start + len(segment.token_ids)]
                start += len(segment.token_ids)
    return trees


def varied_script():
    """A script whose trees of one group differ (identical trees get advantages that cancel):
    the demo task's root delegates L1 and L2, both lists to one clone, or answers at once,
    in turn; a clone answers the sum of its lists; the short task's root answers at once,
    with a longer text every other time."""
    turn = itertools.count()

    def respond(prompt: str) -> str:
        assistant = prompt.rsplit("<|im_start|>assistant\n", 1)[1]
        n = next(turn)
        if "</return>" in assistant:
            return "Answer: 10"
        if "L1 L2" in prompt:
            return ["<spawn>sum @L1<sep>sum @L2</spawn>", "<spawn>sum @L1 @L2</spawn>",
                    "Answer: 9"][n % 3]
        if "[L1]" in prompt:
            return "Answer: 10" if "[L2]" in prompt else "Answer: 3"
        return ("Answer: 7" if "[L2]" in prompt
                else ["Answer: 0", "I think it is zero. Answer: 0"][n % 2])
    return respond


def test_packed_rows_train_exactly_as_one_sample_per_row(tmp_path, spawning_policy, demo_task):
    """The same trees (roots and clones of different lengths) give the same update packed
    and unpacked: packed samples see only themselves. Packing's other promise, less
    padding, is counted on these test-written lengths: several short samples share a row."""
    tasks = [demo_task, Task("short", "Hi.", "0", {})]
    trees = scored(scripted_trees(spawning_policy, tasks, varied_script()))
    results = {}
    for packing in (False, True):
        # Rows run whole unpacked too (shared prompts: the next test).
        config = small_config(tmp_path / str(packing), packing=packing, share_prompt_forward=False,
                              lr=1e-2)
        config.algo.loss.kl_coef = 0.1  # the reference forward packs too
        results[packing] = one_update(config, spawning_policy, trees, tasks)
    assert_same_update(results[False], results[True])
    lengths = [s.length
               for s in samples_from_trees(trees, compute_advantages(trees, config.algo.credit))]
    budget = config.trainer.tokens_per_micro_batch
    width = packing_width(lengths, budget)
    packed = padding_fraction(lengths, packed_micro_batches(lengths, budget), width)
    unpacked = padding_fraction(lengths, make_micro_batches(
        lengths, budget, pass_overhead_tokens=config.trainer.pass_overhead_tokens))
    assert (results[True][0]["train/padding_frac"],
            results[False][0]["train/padding_frac"]) == (packed, unpacked)
    assert packed < unpacked


def test_shared_prompts_train_as_one_pass_per_row(tmp_path, spawning_policy, demo_task,
                                                  monkeypatch):
    """trainer.share_prompt_forward: the same trees give the same update with each group's
    prompt run once in the policy's forward as with every row run whole (the reference, a
    separate model here, shares its prompts too)."""
    tasks = [demo_task, Task("short", "Hi.", "0", {})]
    trees = scored(scripted_trees(spawning_policy, tasks, varied_script()))
    results, rows_seen, cuts, cut = {}, {}, {}, trainer_module.make_micro_batches
    for share in (False, True):
        config = small_config(tmp_path / str(share), share_prompt_forward=share, lr=1e-2)
        config.algo.loss.kl_coef = 0.1
        seen = rows_seen[share] = []

        def recording_cut(lengths, *args, share=share, **kwargs):
            cuts[share] = (lengths, kwargs["prompts"])
            return cut(lengths, *args, **kwargs)
        monkeypatch.setattr(trainer_module, "make_micro_batches", recording_cut)
        results[share] = one_update(config, spawning_policy, trees, tasks,
                                    hook=lambda _, args, kwargs,
                                    seen=seen: seen.append(len(kwargs["input_ids"])))
    assert_same_update(results[False], results[True])
    # Sharing adds a pass over fewer rows than any micro-batch has.
    assert len(
        rows_seen[True]) > len(rows_seen[False]) and min(rows_seen[True]) < min(rows_seen[False])
    # Micro-batches are cut knowing that a group's prompt runs once (batching.py's tests):
    # each sample's tokens before its first sampled one, which the trees' copies repeat.
    lengths, prompts = cuts[True]
    assert cuts[False][1] is None and len(prompts) == len(lengths)
    assert all(0 < len(prompt) < length for prompt, length in zip(prompts, lengths))
    assert len(set(prompts)) < len(prompts)


def test_a_model_that_lets_packed_samples_meet_is_refused(tmp_path):
    """A model whose attention ignores where positions restart would train packed samples
    on their neighbours' tokens: the trainer refuses it and names the setting."""
    config = small_config(tmp_path, packing=True)
    policy = build_policy(config)
    forward = policy.model.forward

    def causal_over_the_whole_row(*args, position_ids=None, attention_mask=None, **kwargs):
        return forward(*args, **kwargs)

    policy.model.forward = causal_over_the_whole_row
    with pytest.raises(ConfigError, match="trainer.packing=false"):
        build_trainer(config, policy=policy)
    config.trainer.packing = False
    build_trainer(config, policy=policy).close()


def test_the_update_is_timed_by_phase_and_the_final_save_can_be_skipped(tmp_path):
    config = small_config(tmp_path, steps=2, save_final=False)
    config.algo.loss.kl_coef = 0.1
    trainer = build_trainer(config)
    history = trainer.train()
    trainer.close()
    assert not (tmp_path / "run" / "checkpoints").exists()
    for metrics in history:
        phases = [metrics[f"time/{p}"] for p in ("forward", "reference", "backward", "optimizer")]
        assert all(seconds > 0 for seconds in phases)
        assert sum(phases) <= metrics["time/training"]


def test_two_processes_with_one_seed_train_bitwise_the_same(tmp_path):
    """The whole run, in fresh processes with different hash seeds (so nothing may depend on
    set order or object ids): the same sampled tokens, metrics and final weights, bit for bit."""
    reward_file = tmp_path / "digit_reward.py"
    # A factory, so the task group's reward_params (cost: null) have somewhere to go.
    reward_file.write_text(DIGIT_REWARD + "\n\ndef digits(**params):\n    return reward\n")

    def run(name: str, hash_seed: str) -> tuple[bytes, list[dict]]:
        out = tmp_path / name
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run(
            [sys.executable, "-m", "selfcest.train", "model=tiny", "trainer.steps=2",
             "trainer.lr=1e-2",
             "trainer.prompts_per_step=4", f"task.reward={reward_file}:digits",
             "log.progress=false",
             "log.trees_every=1", "rollout.budget.node_generation=24", f"trainer.output_dir={out}"],
            check=True, env=env, capture_output=True, cwd=tmp_path)
        weights = (out / "checkpoints" / "step_000002" / "model.safetensors").read_bytes()
        rows = [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}
                for row in read_metrics(out / "metrics.jsonl")]
        trees = [(out / "trees" / f.name).read_text() for f in sorted((out / "trees").iterdir())]
        return weights, rows, trees

    first, second = run("a", "1"), run("b", "2")
    assert all(row["train/optimizer_steps"] == 1 for row in first[1]) and len(first[2]) == 2
    assert first[1] == second[1]
    assert first[2] == second[2]
    assert first[0] == second[0]


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)])
def test_protocol_none_trains_a_flat_step_on_the_loaded_vocabulary(tmp_path, lora):
    """model.protocol=none (with the default max_depth): two steps train every trainable
    parameter (LoRA's A only moves once B has), no tree spawns, no token is added and LoRA
    trains no embedding row."""
    config = small_config(tmp_path, steps=2, lr=1e-2)
    config.model.protocol = "none"
    config.model.lora = lora
    trainer = build_trainer(config)
    vocabulary = len(build_tokenizer(protocol_tokens=False))
    assert len(trainer.policy.tokenizer) == vocabulary
    assert trainer.policy.model.get_input_embeddings().weight.shape[0] == vocabulary
    before = params_of(trainer.policy.model)
    trainable = {n for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
    trees = trainer.engine(seed=0).rollout(trainer.train_tasks[:4], 4)
    history = trainer.train()
    trainer.close()
    after = params_of(trainer.policy.model)
    assert [h["train/optimizer_steps"] for h in history] == [1, 1]
    assert not [n for n in trainable if torch.equal(before[n], after[n])]
    assert not any("trainable_tokens" in n for n in trainable)
    assert all(list(t.nodes) == ["0"] for t in trees)


def spawn_probability(policy: ClonePolicy, task: Task) -> float:
    ids = torch.tensor([policy.protocol.root_prompt(task)])
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[0, -1]
    return float(torch.softmax(logits, -1)[policy.protocol.spawn_open_id])


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_the_decision_entropy_bonus_alone_pulls_a_certain_decision_toward_a_coin_flip(
        tmp_path, spawning_policy, demo_task, coef):
    """With every advantage 0 the policy term gives no gradient; the decision bonus then moves
    P(the root opens a spawn call) from near 1 toward 0.5, and nothing moves without it."""
    policy = ClonePolicy(copy.deepcopy(spawning_policy.model), spawning_policy.tokenizer,
                         spawning_policy.protocol)
    config = small_config(tmp_path, lr=1e-2)
    config.algo.loss.decision_entropy_coef = coef
    trainer = build_trainer(config, policy=policy, train_tasks=[demo_task])
    (tree,) = policy.engine(Budget(max_depth=1), SamplingParams(temperature=0)).rollout([demo_task])
    samples = samples_from_trees([tree], Advantages([{n: 0.0 for n in tree.nodes}], [True], {}))
    before = spawn_probability(trainer.policy, demo_task)
    metrics = trainer._update(samples)
    after = spawn_probability(trainer.policy, demo_task)
    trainer.close()
    assert before > 0.9
    if coef:
        assert before - after > 1e-3 and metrics["loss/decision_entropy"] > 0
    else:
        assert after == before and "loss/decision_entropy" not in metrics


def test_each_step_logs_how_often_roots_delegate_at_each_task_size(
    tmp_path, spawning_policy, demo_task):
    trainer = build_trainer(small_config(tmp_path), policy=spawning_policy, train_tasks=[demo_task])
    (delegating,) = spawning_policy.engine(Budget(max_depth=1),
                                           SamplingParams(temperature=0)).rollout([demo_task])
    direct = copy.deepcopy(delegating)
    # "Answer: 10"
    direct.root.segments = [s for s in direct.root.segments if s.kind == "sampled"][-1:]
    larger = Task("larger", "Add all numbers in L1 L2 L3.", "12", {**demo_task.context, "L3": "2"})
    other = copy.deepcopy(delegating)
    other.task_id = "larger"
    metrics = trainer._decision_metrics([delegating, direct, other],
                                        {"demo": demo_task, "larger": larger})
    trainer.close()
    assert metrics == {"decision/p_delegate": 2 / 3, "decision/p_delegate/size_2": 0.5,
                       "decision/p_delegate/size_3": 1.0}


def test_trees_whose_reward_fails_score_0_counted_and_nan_never_reaches_the_loss(tmp_path, caplog):
    """Of each group of 4 trees one reward raises, one returns NaN, one a string: those score
    0, reward/errors logs 3/4, the loss and the weights stay finite, and the run goes on."""
    digits = load_reward(small_config(tmp_path).task.reward)

    def moody(tree, task):
        kind = tree.sample_index % 4
        if kind == 0:
            raise ValueError("boom")
        return [None, RewardResult(math.nan, False), RewardResult("high", False),
                digits(tree, task)][kind]

    trainer = build_trainer(small_config(tmp_path, steps=2, lr=1e-2), reward_fn=moody)
    with caplog.at_level("WARNING"):
        history = trainer.train()
    trainer.close()
    assert [row["reward/errors"]
            for row in read_metrics(tmp_path / "run/metrics.jsonl")] == [0.75, 0.75]
    assert "step 1: the reward failed on 12 of 16 trees, scored 0 (first: tree " in caplog.text
    assert "#0: ValueError: boom" in caplog.text
    assert all(math.isfinite(h["loss/pg_loss"]) and h["train/optimizer_steps"] == 1
               for h in history)
    assert all(torch.isfinite(p).all() for p in trainer.policy.model.parameters())


def test_a_run_whose_rewards_all_fail_stops_saying_why(tmp_path):
    trainer = build_trainer(small_config(tmp_path, steps=3, save_every=1), reward_fn=lambda tree,
                            task: math.nan)
    with pytest.raises(RunError, match=r"step 1: the reward failed on every tree \(tree .*#0: "
                                       r"returned nan, not a RewardResult\); nothing can be "
                                       r"learned from rewards that all fail"):
        trainer.train()
    trainer.close()
    assert not (tmp_path / "run/checkpoints").exists()
    assert (tmp_path / "run/metrics.jsonl").read_text() == ""


def test_a_hanging_reward_is_cut_off_by_its_timeout_and_counted(tmp_path):
    """task.reward_timeout_s: the reward runs in a worker process; the one call that hangs
    is cut off, its tree scores 0 (reward/timeouts: 1 of 16 trees) and the run finishes."""
    config = small_config(tmp_path, steps=1)
    spec = config.task.reward
    (tmp_path / "hangs.py").write_text(
        "import time\nfrom selfcest.rewards.base import load_reward\ndigits = "
        f"load_reward({spec!r})\n"
        "def reward(tree, task):\n"
        "    if tree.task_index == 0 and tree.sample_index == 0:\n        time.sleep(60)\n"
        "    return digits(tree, task)\n")
    config.task.reward, config.task.reward_timeout_s = f"{tmp_path / 'hangs.py'}:reward", 1.0
    with pytest.raises(ConfigError, match="a reward_fn given in Python runs in this one"):
        build_trainer(config, reward_fn=lambda tree, task: RewardResult(0.0, False))
    trainer = build_trainer(config)
    start = time.monotonic()
    (metrics,) = trainer.train()
    trainer.close()
    assert time.monotonic() - start < 60  # the hang alone would take that (uncut, the test fails)
    assert metrics["reward/timeouts"] == 1 / 16 and "reward/errors" not in metrics


def test_updates_with_non_finite_gradients_are_skipped_counted_and_stop_the_run(tmp_path):
    """Every backward pass here gives one parameter NaN gradients: each update is skipped
    (no weight, optimizer or schedule moves) and counted; the second in a row stops the run."""
    config = small_config(tmp_path, steps=4, lr=1e-2)
    config.trainer.max_nonfinite_updates = 2
    trainer = build_trainer(config)
    before = params_of(trainer.policy.model)
    trainer.policy.model.get_output_embeddings().weight.register_hook(lambda grad: grad * math.nan)
    with pytest.raises(RunError, match=r"step 2: 2 updates in a row were skipped for a non-finite "
                                       r"loss, gradient or policy \(last: gradient norm nan; "
                                       r"trainer.max_nonfinite_updates\)"):
        trainer.train()
    trainer.close()
    (row,) = read_metrics(tmp_path / "run/metrics.jsonl")
    assert (row["train/nonfinite_skipped"], row["train/optimizer_steps"]) == (1, 0)
    assert all(torch.equal(before[n], p) for n, p in trainer.policy.model.named_parameters())
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0


def test_a_learning_rate_that_blows_up_stops_the_run_without_saving_nan(tmp_path):
    """lr 1e30: the first update leaves weights near 1e30, whose logits overflow, so every
    later tree is sampled with NaN logprobs. Those updates are skipped and counted; the
    third in a row stops the run. Every checkpoint saved holds finite weights."""
    trainer = build_trainer(small_config(tmp_path, steps=8, lr=1e30, save_every=1,
                                         keep_checkpoints=8))
    with pytest.raises(RunError, match=r"step 4: 3 updates in a row .*\(last: 16 trees sampled "
                                       r"with NaN logprobs; .*the learning rate "
                                       r"\(trainer.lr=1e\+30\) may be too high. Last checkpoint: "
                                       r".*step_000003"):
        trainer.train()
    trainer.close()
    rows = read_metrics(tmp_path / "run/metrics.jsonl")
    assert [row.get("train/nonfinite_skipped", 0) for row in rows] == [0, 1, 1]
    for folder in list_checkpoints(tmp_path / "run"):
        assert all(torch.isfinite(t).all()
                   for t in load_file(folder / "model.safetensors").values())


def scripted_evaluations(monkeypatch, values: dict[int, float]) -> None:
    """Every evaluation scores ``values[step]`` (the step the trainer is at): the selection
    under test, on real training steps."""
    monkeypatch.setattr(GRPOTrainer, "evaluate",
                        lambda self, tasks=None: {"eval/reward/mean": values[self.state.step]})


def saved_weights(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def test_keep_best_ends_with_the_best_evaluated_weights_earliest_on_ties(tmp_path, monkeypatch):
    """Evaluations 0.5, 0.9, 0.3, 0.9 at steps 0, 2, 4, 6: the run ends with step 2's
    weights, while its checkpoints keep the last ones for a resume."""
    scripted_evaluations(monkeypatch, {0: 0.5, 2: 0.9, 4: 0.3, 6: 0.9})
    config = small_config(tmp_path, steps=6, lr=1e-2, eval_every=2, save_every=2,
                          keep_checkpoints=3, keep_best="eval/reward/mean")
    trainer = build_trainer(config)
    trainer.train()
    trainer.close()
    run = tmp_path / "run"
    final = params_of(trainer.policy.model)
    kept, last = saved_weights(run, 2), saved_weights(run, 6)
    assert all(torch.equal(final[name], kept[name]) for name in kept)
    assert not all(torch.equal(kept[name], last[name]) for name in kept)
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 2
    assert [p.name for p in list_checkpoints(run / "best")] == ["step_000002"]
    evaluations = [json.loads(line) for line in (run / "best" / "evaluations.jsonl").open()]
    assert [(e["step"], e["value"]) for e in evaluations] == [(0, 0.5), (2, 0.9), (4, 0.3),
                                                               (6, 0.9)]


def test_keep_best_keeps_the_starting_weights_when_no_step_beats_them(tmp_path, monkeypatch):
    scripted_evaluations(monkeypatch, {0: 0.9, 2: 0.5, 4: 0.9})
    config = small_config(tmp_path, steps=4, lr=1e-2, eval_every=2,
                          keep_best="eval/reward/mean")
    trainer = build_trainer(config)
    start = params_of(trainer.policy.model)
    trainer.train()
    trainer.close()
    final = params_of(trainer.policy.model)
    assert all(torch.equal(start[name], final[name]) for name in start)


def test_a_resumed_run_keeps_the_best_of_evaluations_made_before_it_stopped(tmp_path,
                                                                           monkeypatch):
    scripted_evaluations(monkeypatch, {0: 0.1, 2: 0.9, 4: 0.5})

    def trainer_for(resume=False):
        return build_trainer(small_config(tmp_path, steps=4, lr=1e-2, eval_every=2,
                                          save_every=2, keep_checkpoints=3, resume=resume,
                                          keep_best="eval/reward/mean"))

    first = trainer_for()
    first._keep_if_best(first.evaluate())  # what train() runs before a crash: this, 2 steps
    for _ in range(2):
        first.step()
    first.save()
    first.close()
    resumed = trainer_for(resume=True)
    resumed.train()
    resumed.close()
    kept, final = saved_weights(tmp_path / "run", 2), params_of(resumed.policy.model)
    assert all(torch.equal(final[name], kept[name]) for name in kept)


def test_keep_best_only_selects_the_trained_weights_are_the_same(tmp_path):
    """Real evaluations (sampled, several per task) and best saves, the starting weights'
    included, change nothing that training does: the last checkpoint is bitwise the one of a
    run without them. (Reading a fresh optimizer's state for a checkpoint would create it and
    move the first update; the best is saved without it.)"""

    def last_weights(folder, **evaluation):
        config = small_config(tmp_path / folder, steps=3, lr=1e-2, **evaluation)
        config.task.params["train"] = {"inline": True}
        trainer = build_trainer(config)
        trainer.train()
        trainer.close()
        return saved_weights(tmp_path / folder / "run", 3)

    plain = last_weights("plain")
    selected = last_weights("selected", eval_every=1, eval_samples=2,
                            keep_best="eval/reward/mean")
    assert all(torch.equal(plain[name], selected[name]) for name in plain)
    evaluations = (tmp_path / "selected" / "run" / "best" / "evaluations.jsonl").read_text()
    assert evaluations.count("\n") == 4


@pytest.mark.parametrize(("setting", "message"), [
    ({"keep_best": "eval/reward/mean"}, "needs trainer.eval_every > 0"),
    ({"keep_best": "reward/mean", "eval_every": 2}, "must name an evaluation metric"),
])
def test_keep_best_without_evaluations_is_refused_before_any_step(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=f"keep_best.*{message}"):
        build_trainer(small_config(tmp_path, steps=2, **setting))


def test_keep_best_of_a_metric_evaluations_do_not_report_names_those_they_do(tmp_path):
    config = small_config(tmp_path, steps=2, eval_every=1, keep_best="eval/no_such_metric")
    trainer = build_trainer(config)
    with pytest.raises(ConfigError, match="eval/no_such_metric.*eval/reward/mean"):
        trainer.train()
    trainer.close()
