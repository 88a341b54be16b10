"""GRPO over clone trees: the global reward of each tree is pushed through every branch.

One training step::

    tasks   = the next `prompts_per_step` prompts (prompt i belongs to process i % world)
    trees   = engine.rollout(my tasks, trees_per_prompt)       # every branch, every tree
    rewards = reward_fn(tree, task) for each tree               # one global score per tree
    adv     = compute_advantages(trees, credit)                 # group-relative, then credit
    samples = one per node: its full context, trained on its sampled tokens only
    for each of `optimizer_steps_per_step` optimizer steps:
        micro-batches under a token budget, PPO-clip loss, exact global aggregation
    backend.sync_weights(model)                                 # next rollout sees new weights

A group (all trees of one prompt) always lands on one process, so its advantages are
computed where all its trees are; metrics are averaged across processes. Trees are rolled
out by each process's own engine, or by its node's (`node_rollout.py`); training is data
parallel or FSDP2-sharded (`sharding.py`).

Simplifications, stated: the rollout and the update alternate (no asynchronous rollout);
counterfactual credit re-runs only the continuation of the root (clones of clones take
their depth-1 ancestor's counterfactual credit).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed

from selfcest.algo.advantages import COUNTERFACTUAL_KEY, compute_advantages
from selfcest.algo.losses import (
    aggregation_weights,
    combine_stats,
    per_token_loss,
    token_entropy,
)
from selfcest.policy import SIZES, ClonePolicy
from selfcest.rewards.base import RewardFn, load_reward, progress_summary, reward_components, score_trees
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.engine import RolloutEngine
from selfcest.tasks.base import Task
from selfcest.train.batching import (
    TrainingSample,
    collate,
    forward_logprobs,
    make_micro_batches,
    padding_fraction,
    samples_from_trees,
    split_for_optimizer_steps,
)
from selfcest.train.checkpoint import TrainerState, load_checkpoint, resolve_resume, save_checkpoint
from selfcest.train.config import SMOLLM2, ConfigError, TrainConfig, load_split, validate
from selfcest.train.logging import RunLogger
from selfcest.train.schedule import lr_lambda
from selfcest.train.node_rollout import FollowerBackend, Placement, rollout_on_node
from selfcest.train.sharding import check_model, check_supported, full_weights, is_sharded
from selfcest.train.sft import logged_warm_start
from selfcest.tree import CloneTree

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TaskSampler:
    """Seeded, resumable order over the training tasks: a fresh shuffle every epoch."""

    def __init__(self, tasks: Sequence[Task], seed: int, epoch: int = 0, cursor: int = 0) -> None:
        if not tasks:
            raise ValueError("no training tasks")
        self.tasks, self.seed, self.epoch, self.cursor = list(tasks), seed, epoch, cursor

    def _order(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def take(self, n: int) -> list[Task]:
        picked = []
        while len(picked) < n:
            if self.cursor >= len(self.tasks):
                self.epoch, self.cursor = self.epoch + 1, 0
            picked.append(self.tasks[self._order()[self.cursor]])
            self.cursor += 1
        return picked


def build_policy(config: TrainConfig) -> ClonePolicy:
    """The policy a config describes: a built-in tiny size or a model folder."""
    model = config.model
    if model.name in SIZES:
        policy = ClonePolicy.build_tiny(seed=model.init_seed, size=model.name, protocol=model.protocol,
                                        root_system=model.root_system, clone_system=model.clone_system)
        if model.lora is not None:
            from selfcest.policy import apply_lora

            required = list(policy.protocol.required_tokens)
            policy.model = apply_lora(policy.model, model.lora, policy.tokenizer.convert_tokens_to_ids(required))
        return policy
    if model.name == SMOLLM2:
        return ClonePolicy.from_smollm2(protocol=model.protocol, lora=model.lora, dtype=DTYPES[model.dtype],
                                        root_system=model.root_system, clone_system=model.clone_system)
    kwargs = {"gguf_file": model.gguf_file} if model.gguf_file else {}
    return ClonePolicy.from_pretrained(
        model.name, protocol=model.protocol, lora=model.lora, dtype=DTYPES[model.dtype],
        root_system=model.root_system, clone_system=model.clone_system, **kwargs,
    )


def build_reward(config: TrainConfig) -> RewardFn:
    """The reward named by ``task.reward`` (a factory is called with ``task.reward_params``)."""
    try:
        return load_reward(config.task.reward, config.task.reward_params)
    except ValueError as error:
        raise ConfigError(f"task.reward: {error}") from None


class GRPOTrainer:
    """Trains a `ClonePolicy` on clone trees with group-relative advantages (see module doc)."""

    def __init__(
        self,
        config: TrainConfig,
        policy: ClonePolicy | None = None,
        train_tasks: Sequence[Task] | None = None,
        eval_tasks: Sequence[Task] | None = None,
        reward_fn: RewardFn | None = None,
        backend=None,
    ) -> None:
        validate(config)
        self.config = config
        trainer = config.trainer
        # Everything that can fail on a bad config fails here, before any model is built.
        self.reward_fn = reward_fn or build_reward(config)
        task = config.task
        self.train_tasks = list(train_tasks) if train_tasks is not None else load_split(task, "train")
        if eval_tasks is None and trainer.eval_every:
            eval_tasks = load_split(task, "eval")
        self.eval_tasks = list(eval_tasks or [])[: task.eval_size]
        resume_from = resolve_resume(trainer.resume, trainer.output_dir)

        if trainer.cpu_threads:
            torch.set_num_threads(trainer.cpu_threads)
        # cpu=True on machines without CUDA: without it, two CPU processes each think they
        # are alone and never synchronise gradients.
        self.accelerator = acc = Accelerator(cpu=not torch.cuda.is_available())
        check_supported(acc)
        # Seeded global RNGs (dropout, any library sampling): a run's result must not depend
        # on what the process did before it. A resume restores the checkpoint's states.
        set_seed(trainer.seed, device_specific=True)
        self.sharded = is_sharded(acc)
        # Where rollouts happen: in every process, or on each node's first (node_rollout.py).
        self.placement = None
        if config.rollout.engine_per_node:
            self.placement = Placement.of(acc.process_index, acc.num_processes)
        policy = policy or build_policy(config)
        model = policy.model
        if self.sharded:
            check_model(model)
        if resume_from is None and config.warm_start.tasks:
            self._warm_start(policy)
        if config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        device = acc.device
        # Built before sharding, from full weights: the KL reference, and the model rollouts
        # decode with. Under FSDP the latter is a copy of its own (see sharding.py).
        self.reference = self._reference_model(model, device)
        self.rollout_model = model
        if self.sharded:
            self.rollout_model = copy.deepcopy(model).to(device).eval().requires_grad_(False)
        self.policy = ClonePolicy(self.rollout_model, policy.tokenizer, policy.protocol)
        self.backend = backend or self._build_backend()
        if backend is not None and config.warm_start.tasks and resume_from is None:
            self.backend.sync_weights(self.rollout_model)  # it was built before the warm start
        self._follow_leader_version()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=trainer.lr,
                                      betas=tuple(trainer.betas), weight_decay=trainer.weight_decay)
        total_updates = trainer.steps * trainer.optimizer_steps_per_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(trainer.schedule, trainer.warmup_steps, total_updates))
        self.model, self.optimizer = acc.prepare(model, optimizer)
        # After prepare: under FSDP the parameters are new (sharded) tensors.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.state = TrainerState(step=0, epoch=0, cursor=0, weight_version=self.backend.weight_version)
        if resume_from is not None:
            self.state = load_checkpoint(resume_from, self._unwrapped, self.optimizer, self.scheduler,
                                         rank=acc.process_index)
            self._publish_weights()
            # The checkpoint's weights are served under the version they had when it was
            # written, so a resumed run numbers its versions as the straight run does.
            self.backend.weight_version = self.state.weight_version
        self.sampler = TaskSampler(self.train_tasks, trainer.seed, self.state.epoch, self.state.cursor)
        self.logger = None
        if acc.is_main_process:
            self.logger = RunLogger(trainer.output_dir, asdict(config), config.log.wandb,
                                    config.log.wandb_project, config.name, config.log.tensorboard,
                                    resume=resume_from is not None)
        self.resumed_from = resume_from

    # ------------------------------------------------------------------ setup helpers

    def _warm_start(self, policy: ClonePolicy) -> None:
        """Supervised warm start on teacher demonstrations, before sharding and the first
        step. Every process runs it identically (same data, same seed), so they agree."""
        logged_warm_start(policy, self.config, Path(self.config.trainer.output_dir))

    @property
    def _unwrapped(self):
        """The training model without its DDP wrapper (under FSDP: the sharded model)."""
        return self.accelerator.unwrap_model(self.model)

    def _build_backend(self):
        rollout = self.config.rollout
        if self.placement is not None and not self.placement.is_leader:
            return FollowerBackend()
        if rollout.backend == "vllm":
            from selfcest.rollout.backends.vllm import VLLMBackend

            return VLLMBackend.from_policy(self.policy, **rollout.vllm)
        from selfcest.rollout.backends.hf import HFBackend

        return HFBackend(self.rollout_model, self.policy.tokenizer.pad_token_id, rollout.max_batch_size)

    def _publish_weights(self) -> None:
        """Make rollouts use the trained weights (after an update, or a resume)."""
        if self.sharded:
            self.rollout_model.load_state_dict(full_weights(self.model))
        self.backend.sync_weights(self.rollout_model)
        self._follow_leader_version()

    def _follow_leader_version(self) -> None:
        """With an engine per node, take the weight version the node's engine serves."""
        if self.placement is not None:
            self.backend.weight_version = self._gather(self.backend.weight_version)[self.placement.leader]

    def _rollout(self, tasks: Sequence[Task], samples_per_task: int, engine: RolloutEngine) -> list[CloneTree]:
        """This process's trees for its share of the step's ``tasks`` (prompt i goes to
        process i % world size), from its own engine or its node's."""
        acc = self.accelerator
        if self.placement is None:
            return engine.rollout(tasks[acc.process_index :: acc.num_processes], samples_per_task)
        return rollout_on_node(self.placement, tasks, samples_per_task,
                               lambda mine: engine.rollout(mine, samples_per_task))

    def _reference_model(self, model, device):
        """The KL reference: the base with the adapter disabled (LoRA), else a frozen copy."""
        if self.config.algo.loss.kl_coef == 0 or hasattr(model, "disable_adapter"):
            return None
        return copy.deepcopy(model).to(device).eval().requires_grad_(False)

    def engine(self, seed: int, budget=None) -> RolloutEngine:
        rollout = self.config.rollout
        sampling = SamplingParams(rollout.temperature, rollout.top_p, rollout.top_k)
        return RolloutEngine(self.backend, self.policy.protocol, budget or rollout.budget, sampling,
                             seed=seed, call_timeout_s=rollout.call_timeout_s)

    def _step_seed(self, step: int) -> int:
        key = f"{self.config.trainer.seed}:{step}:{self.accelerator.process_index}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict[str, float]]:
        """Run until `trainer.steps`; return the metrics of every step run."""
        trainer = self.config.trainer
        history = []
        progress = None
        if self.accelerator.is_main_process and self.config.log.progress:
            from tqdm.auto import tqdm

            progress = tqdm(total=trainer.steps, initial=self.state.step, desc=self.config.name)
        try:
            while self.state.step < trainer.steps:
                metrics = self.step()
                history.append(metrics)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(progress_summary(metrics))
                if trainer.save_every and self.state.step % trainer.save_every == 0:
                    self.save()
            if not trainer.save_every or self.state.step % trainer.save_every:
                self.save()
        finally:
            if progress is not None:
                progress.close()
        return history

    def step(self) -> dict[str, float]:
        """One training step (rollout, scoring, update, sync); returns its metrics."""
        trainer, acc = self.config.trainer, self.accelerator
        timings = {}
        start = time.perf_counter()
        tasks = self.sampler.take(trainer.prompts_per_step)
        local = tasks[acc.process_index :: acc.num_processes]
        trees = self._rollout(tasks, trainer.trees_per_prompt, self.engine(self._step_seed(self.state.step)))
        timings["time/rollout"] = time.perf_counter() - start

        mark = time.perf_counter()
        by_id = {t.id: t for t in local}
        score_trees(trees, by_id, self.reward_fn)
        if self.config.algo.credit.strategy == "counterfactual":
            self._counterfactual(trees, by_id)
        timings["time/scoring"] = time.perf_counter() - mark

        mark = time.perf_counter()
        self.backend.sleep()  # free the engine's memory for the update (vLLM sleep mode)
        metrics = self.train_on_trees(trees)
        timings["time/training"] = time.perf_counter() - mark

        mark = time.perf_counter()
        self._publish_weights()
        timings["time/sync"] = time.perf_counter() - mark

        self.state = TrainerState(self.state.step + 1, self.sampler.epoch, self.sampler.cursor,
                                  self.backend.weight_version)
        timings["time/step"] = time.perf_counter() - start
        metrics.update(self._tree_metrics(trees))
        metrics.update(timings)
        generated = self._sum_over_processes({"n": sum(t.costs().generated_tokens for t in trees)})["n"]
        metrics["throughput/rollout_tokens_per_s"] = generated / max(timings["time/rollout"], 1e-9)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        if trainer.eval_every and self.state.step % trainer.eval_every == 0 and self.eval_tasks:
            metrics.update(self.evaluate())
        self._log(metrics, trees)
        return metrics

    # ------------------------------------------------------------------ the update

    def train_on_trees(self, trees: Sequence[CloneTree]) -> dict[str, float]:
        """Advantages, samples and `optimizer_steps_per_step` updates on scored trees."""
        config = self.config
        advantages = compute_advantages(trees, config.algo.credit)
        samples = samples_from_trees(trees, advantages)
        samples, stale = self._handle_stale(samples)
        metrics = self._mean_over_processes(advantages.metrics)
        metrics["samples/stale_refused"] = self._sum_over_processes({"n": stale})["n"]
        metrics.update(self._update(samples))
        return metrics

    def _handle_stale(self, samples: list[TrainingSample]) -> tuple[list[TrainingSample], int]:
        """Refuse samples drawn under older weights, or keep them for importance correction."""
        if self.config.algo.stale_samples == "correct":
            return samples, 0
        current = self.backend.weight_version
        fresh = [s for s in samples if s.weight_version in (None, current)]
        return fresh, len(samples) - len(fresh)

    def _update(self, samples: list[TrainingSample]) -> dict[str, float]:
        trainer, acc = self.config.trainer, self.accelerator
        lengths = [s.length for s in samples]
        micro = make_micro_batches(lengths, trainer.tokens_per_micro_batch)
        trainable = [s.num_trainable for s in samples]
        plan = split_for_optimizer_steps(micro, trainer.optimizer_steps_per_step, trainable)
        algo = self.config.algo
        # Kept stale samples need old logprobs under the current weights: the truncated
        # importance weight compares them with the logprobs the tokens were sampled under.
        recompute = algo.recompute_old_logprobs or algo.stale_samples == "correct"
        proximal = self._proximal_logprobs(samples, micro) if recompute else None
        # Tree ids made unique across processes for tree_mean aggregation.
        tree_ids = [s.tree_id * acc.num_processes + acc.process_index for s in samples]
        stats, grad_norms, trained_tokens, updates = [], [], 0, 0
        start = time.perf_counter()
        self.model.train()
        for step_batches in plan:
            members = [i for batch in step_batches for i in batch]
            weights, total = self._global_weights([trainable[i] for i in members],
                                                  [tree_ids[i] for i in members])
            if total == 0:
                # No process has a token to learn from: skip the update entirely (an AdamW
                # step on zero gradients would still move the weights by its momentum).
                continue
            weight_of = dict(zip(members, weights))
            batches = step_batches or [[]]  # a process without samples still joins the all-reduce
            if self.sharded:
                # Every forward and backward is a collective under FSDP: all processes run as
                # many micro-batches, the ones with fewer padded with empty ones.
                batches += [[]] * (max(self._gather(len(batches))) - len(batches))
            for j, batch in enumerate(batches):
                sync = j == len(batches) - 1
                with contextlib.nullcontext() if sync else acc.no_sync(self.model):
                    rows = [samples[i] for i in batch]
                    old = [proximal[i] for i in batch] if proximal is not None else None
                    stats.append(self._backward(rows, [weight_of[i] for i in batch], old))
                    trained_tokens += sum(samples[i].length for i in batch)
            if trainer.max_grad_norm:
                norm = acc.clip_grad_norm_(self.params, trainer.max_grad_norm)
                grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            updates += 1
        elapsed = time.perf_counter() - start
        counted = [s for s in stats if s["tokens"]]
        local = {f"loss/{k}": v for k, v in combine_stats(counted).items() if k != "tokens"} if counted else {}
        metrics = self._mean_over_processes(local)
        metrics.update(self._sum_over_processes({
            "train/samples": len(samples),
            "train/trainable_tokens": sum(trainable),
            "train/micro_batches": len(micro),
            "throughput/train_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
        }))
        metrics.update(self._mean_over_processes({"train/padding_frac": padding_fraction(lengths, micro)}))
        metrics["train/optimizer_steps"] = updates
        metrics["train/grad_norm"] = statistics.fmean(grad_norms) if grad_norms else 0.0
        return metrics

    def _global_weights(self, counts: list[int], tree_ids: list[int]) -> tuple[list[float], int]:
        """Aggregation weights over one optimizer step's samples of every process, and the
        step's total trainable tokens. This process's share of the weights is returned, scaled
        by the world size because DDP averages gradients over processes."""
        acc = self.accelerator
        mode = self.config.algo.loss.aggregation
        if acc.num_processes == 1:
            return aggregation_weights(counts, tree_ids, mode), sum(counts)
        everyone = gather_object([(counts, tree_ids)])
        all_counts = [c for part, _ in everyone for c in part]
        all_ids = [t for _, part in everyone for t in part]
        weights = aggregation_weights(all_counts, all_ids, mode)
        offset = sum(len(part) for part, _ in everyone[: acc.process_index])
        mine = [w * acc.num_processes for w in weights[offset : offset + len(counts)]]
        return mine, sum(all_counts)

    @torch.no_grad()
    def _proximal_logprobs(self, samples: list[TrainingSample], micro: list[list[int]]) -> list[torch.Tensor]:
        """Logprobs of every sample under the current weights, once, before any update: the
        proximal policy of decoupled PPO (the sampled logprobs become behaviour logprobs).
        The rollout model holds exactly those weights and needs no collective."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        self.rollout_model.eval()
        for batch in micro:
            rows = [samples[i] for i in batch]
            mb = collate(rows, [0.0] * len(rows), self.policy.tokenizer.pad_token_id).to(self.accelerator.device)
            logp, _ = self._logprobs(self.rollout_model, mb)
            for row, i in enumerate(batch):
                out[i] = logp[row, : samples[i].length].float().cpu()
        return out

    def _logprobs(self, model, mb) -> tuple[torch.Tensor, torch.Tensor]:
        """Input-aligned logprobs of the sampling distribution (logits / temperature), and
        the tempered logits."""
        return forward_logprobs(model, mb, self.config.rollout.temperature or 1.0)

    def _backward(self, batch: list[TrainingSample], weights: list[float], proximal) -> dict[str, float]:
        loss_config = self.config.algo.loss
        if not batch:
            # Nothing to learn on this process, but the others all-reduce gradients: take part
            # with a zero loss through a real forward pass (DDP needs its hooks to fire).
            dummy = torch.full((1, 1), self.policy.tokenizer.pad_token_id, device=self.accelerator.device)
            self.accelerator.backward(self.model(input_ids=dummy).logits.sum() * 0.0)
            return {"tokens": 0}
        mb = collate(batch, weights, self.policy.tokenizer.pad_token_id).to(self.accelerator.device)
        logp, logits = self._logprobs(self.model, mb)
        entropy = token_entropy(logits) if loss_config.entropy_coef > 0 else None
        ref = self._reference_logprobs(mb) if loss_config.kl_coef > 0 else None
        old, behaviour = mb.old_logprobs, None
        if proximal is not None:
            old = torch.zeros_like(mb.old_logprobs)
            for row, values in enumerate(proximal):
                old[row, : values.numel()] = values.to(old.device)
            behaviour = mb.old_logprobs
        loss_per_token, stats = per_token_loss(logp, old, mb.advantages, mb.loss_mask, loss_config,
                                               ref_logprobs=ref, entropy=entropy,
                                               behaviour_logprobs=behaviour)
        self.accelerator.backward((loss_per_token * mb.token_weights).sum())
        return stats

    @torch.no_grad()
    def _reference_logprobs(self, mb) -> torch.Tensor:
        """Logprobs under the KL reference: a frozen copy, or the base with LoRA disabled."""
        if self.reference is not None:
            return self._logprobs(self.reference, mb)[0]
        with self.rollout_model.disable_adapter():
            return self._logprobs(self.rollout_model, mb)[0]

    # ------------------------------------------------------------------ counterfactual credit

    def _counterfactual(self, trees: Sequence[CloneTree], tasks: dict[str, Task]) -> None:
        """For each depth-1 clone: mean reward of K re-runs of the root's continuation with
        that clone's answer replaced by a null result (stored in tree.info)."""
        k = self.config.algo.counterfactual_samples
        engine = self.engine(self._step_seed(self.state.step) ^ 0x5EED)
        for tree in trees:
            task = tasks[tree.task_id]
            values = {}
            for clone_id in tree.root.children:
                reruns = engine.rerun_without(tree, task, clone_id, samples=k)
                score_trees(reruns, {task.id: task}, self.reward_fn)
                values[clone_id] = statistics.fmean(t.reward for t in reruns)
            for node in tree.clones():
                ancestor = ".".join(node.id.split(".")[:2])
                if node.depth > 1:
                    values[node.id] = values[ancestor]
            tree.info[COUNTERFACTUAL_KEY] = values

    # ------------------------------------------------------------------ evaluation and logs

    def evaluate(self, tasks: Sequence[Task] | None = None) -> dict[str, float]:
        """Greedy rollouts of the held-out tasks: mean reward, accuracy and costs."""
        tasks = list(tasks if tasks is not None else self.eval_tasks)
        local = tasks[self.accelerator.process_index :: self.accelerator.num_processes]
        rollout = self.config.rollout
        engine = RolloutEngine(self.backend, self.policy.protocol, rollout.budget,
                               SamplingParams(temperature=0), seed=self.config.trainer.seed)
        trees = self._rollout(tasks, 1, engine)
        score_trees(trees, local, self.reward_fn)
        return {f"eval/{k}": v for k, v in self._tree_metrics(trees).items()}

    def _tree_metrics(self, trees: Sequence[CloneTree]) -> dict[str, float]:
        rows = []
        for tree in trees:
            costs = tree.costs()
            calls = sum(len(n.spawns) for n in tree.nodes.values())
            rows.append({
                "reward/mean": tree.reward or 0.0,
                "accuracy": float(bool(tree.correct)),
                "cost/generated_tokens": costs.generated_tokens,
                "cost/root_generated_tokens": costs.root_generated_tokens,
                "cost/clone_generated_tokens": costs.clone_generated_tokens,
                "cost/critical_path_tokens": costs.critical_path_tokens,
                "cost/context_tokens": costs.context_tokens,
                "cost/peak_context": costs.peak_context,
                "tree/clones": costs.clones,
                "tree/depth": costs.depth,
                "tree/spawn_calls": calls,
                "tree/spawn_errors": costs.spawn_errors,
                "tree/spawn_error_rate": costs.spawn_errors / max(1, costs.clones + costs.spawn_errors),
                "tree/truncated": float(any(n.finish_reason == "budget" for n in tree.nodes.values())),
                "tree/errors": float(tree.root.finish_reason == "error"),
                "cost/discarded_tokens": costs.discarded_tokens,
                **reward_components(tree),
            })
        everything = [row for part in self._gather(rows) for row in part]
        if not everything:
            return {}
        # A reward component a tree does not report counts 0 for it (a diagnostic flag that
        # was not raised), so each key is a rate over all trees.
        keys = sorted({key for row in everything for key in row})
        metrics = {key: statistics.fmean(r.get(key, 0.0) for r in everything) for key in keys}
        rewards = [r["reward/mean"] for r in everything]
        metrics["reward/std"] = statistics.pstdev(rewards)
        return metrics

    def _log(self, metrics: dict[str, float], trees: Sequence[CloneTree]) -> None:
        if self.logger is None:
            return
        self.logger.log(self.state.step, metrics)
        every = self.config.log.trees_every
        if every and self.state.step % every == 0:
            self.logger.save_trees(self.state.step, list(trees)[: self.config.log.trees_per_save])

    def save(self) -> Path:
        acc = self.accelerator
        return save_checkpoint(self.config.trainer.output_dir, self.state, self._unwrapped,
                               self.optimizer, self.scheduler, rank=acc.process_index,
                               world_size=acc.num_processes, barrier=acc.wait_for_everyone,
                               keep=self.config.trainer.keep_checkpoints)

    def close(self) -> None:
        """Release the backend and close the logs."""
        self.backend.close()
        if self.logger is not None:
            self.logger.close()

    # ------------------------------------------------------------------ cross-process helpers

    def _gather(self, value) -> list:
        """``value`` of every process, in rank order (one collective call)."""
        if self.accelerator.num_processes == 1:
            return [value]
        return gather_object([value])

    def _sum_over_processes(self, values: dict[str, float]) -> dict[str, float]:
        parts = self._gather(values)
        return {k: float(sum(p.get(k, 0.0) for p in parts)) for k in values}

    def _mean_over_processes(self, values: dict[str, float]) -> dict[str, float]:
        """Per key, the mean over the processes that report it (one collective call)."""
        parts = self._gather(values)
        keys = sorted({k for p in parts for k in p})
        return {k: statistics.fmean(p[k] for p in parts if k in p) for k in keys}
