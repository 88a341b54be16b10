"""GRPO over clone trees: the global reward of each tree is pushed through every branch.

One training step (the rollout and the update alternate: no asynchronous rollout)::

    tasks   = the next `prompts_per_step` prompts (prompt i belongs to process i % world)
    trees   = engine.rollout(my tasks, trees_per_prompt)       # every branch, every tree
    rewards = reward_fn(tree, task) for each tree               # one global score per tree
    adv     = compute_advantages(trees, credit)                 # group-relative, then credit
    samples = one per node: its full context, trained on its sampled tokens only
    for each of `optimizer_steps_per_step` optimizer steps:
        micro-batches under a token budget, PPO-clip loss, exact global aggregation
    backend.sync_weights(model)                                 # next rollout sees new weights

One engine per machine: `machine_rollout.py`; data parallel or FSDP2-sharded: `sharding.py`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from selfcest.algo.advantages import compute_advantages
from selfcest.algo.credit import CREDIT
from selfcest.algo.losses import combine_stats, per_token_loss, token_choice_entropy, token_entropy
from selfcest.configure import ConfigError, RunError
from selfcest.modeling import (
    forward_logprobs,
    left_pad,
    set_activation_checkpointing,
    supports_packing,
)
from selfcest.policy import ClonePolicy
from selfcest.rewards.base import RewardFn, progress_summary, score_trees
from selfcest.rewards.guard import GuardedReward
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.registry import build_backend, spec
from selfcest.rollout.engine import RolloutEngine
from selfcest.rollout.machine_rollout import FollowerBackend, Placement, rollout_on_machine
from selfcest.task import Task
from selfcest.train.batching import (
    TrainingSample,
    collate,
    make_micro_batches,
    packed_micro_batches,
    packing_width,
    padding_fraction,
    samples_from_trees,
    split_for_optimizer_steps,
)
from selfcest.train.checkpoint import (
    TrainerState,
    list_checkpoints,
    load_checkpoint,
    log_evaluation,
    read_best,
    save_best,
    save_checkpoint,
)
from selfcest.train.config import TrainConfig
from selfcest.train.counterfactual import counterfactual_reruns
from selfcest.train.distributed import (
    COMPUTE_DTYPES,
    gather,
    global_weights,
    mean_over_processes,
    sum_over_processes,
)
from selfcest.train.lifecycle import RunLock, StopSignals
from selfcest.train.logging import PhaseTimer, RunLogger, tree_metrics
from selfcest.train.schedule import lr_lambda
from selfcest.train.sharding import is_sharded, refresh_copy, shard_frozen
from selfcest.tree import CloneTree

logger = logging.getLogger(__name__)


def _nan_logprobs(tree: CloneTree) -> bool:
    """Whether a tree was sampled with a NaN logprob: the policy's outputs are not numbers
    (a sum is NaN if any term is, and costs a C loop per segment)."""
    return any(math.isnan(sum(segment.logprobs)) for node in tree.nodes.values()
               for segment in node.segments
               if segment.trainable)


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


def algo_recompute(config: TrainConfig, backend_has_own_weights: bool) -> bool:
    """Whether the update recomputes old logprobs (`AlgoConfig.recompute_old_logprobs`; null:
    unless the backend decodes with the trainer's own model in float32)."""
    chosen = config.algo.recompute_old_logprobs
    if chosen is not None:
        return chosen
    return backend_has_own_weights or config.model.dtype != "float32"


def sync_metrics(backend) -> dict[str, float]:
    """The last weight sync's probe (vLLM), for the step's metrics; nothing for other backends."""
    report = getattr(backend, "last_sync", None)
    if report is None or report.probe_max_diff is None:
        return {}
    return {"sync/probe_max_diff": report.probe_max_diff, "sync/probe_atol": report.probe_atol}


class GRPOTrainer:
    """Trains a `ClonePolicy` on clone trees with group-relative advantages (see module doc)."""

    def __init__(
        self,
        config: TrainConfig,
        accelerator: Accelerator,
        policy: ClonePolicy,
        train_tasks: Sequence[Task],
        reward_fn: RewardFn,
        *,
        eval_tasks: Sequence[Task] = (),
        backend=None,
        resume_from: Path | None = None,
        lock: RunLock | None = None,
    ) -> None:
        """Parts built by `selfcest.train.setup.build_trainer` (use that): the config (already
        validated), the accelerator, the (warm-started) policy, the tasks, the reward, an
        optional backend to roll out with, the checkpoint to resume from, and the output
        folder's lock (released by `close`)."""
        self.config, self.accelerator, self.lock = config, accelerator, lock
        self.stopped_by: str | None = None  # the signal that stopped `train` early, if any
        self.nonfinite_in_row = 0  # updates skipped in a row for a non-finite loss or gradient
        acc = accelerator
        trainer = config.trainer
        self.train_tasks, self.eval_tasks = list(train_tasks), list(eval_tasks)
        if trainer.keep_best and not self.eval_tasks:
            raise ConfigError(f"trainer.keep_best={trainer.keep_best!r} keeps the best evaluated "
                              "weights, and this run has no evaluation tasks: give it some "
                              "(task.eval_params, eval_tasks=) or set trainer.keep_best=''")
        # A reward that fails on a tree scores it 0, counted; a step whose rewards all fail stops.
        self.reward_fn = (reward_fn if isinstance(reward_fn, GuardedReward)
                          else GuardedReward(reward_fn))
        self.sharded = is_sharded(acc)
        # FSDP frees the gathered weights after each forward, so the graph of a first pass over
        # shared prompts cannot be backpropagated after a second pass: rows run whole there.
        self.share_prompts = trainer.share_prompt_forward and not self.sharded
        # Where rollouts happen: in every process, or on each node's first (machine_rollout.py).
        self.placement = None
        if config.rollout.engine_per_node:
            self.placement = Placement.of(acc.process_index, acc.num_processes)
        model = policy.model
        if config.model.gradient_checkpointing:
            set_activation_checkpointing(model)
        if trainer.packing and not supports_packing(model):
            raise ConfigError(
                "trainer.packing: this model lets packed samples attend to each other (its "
                "attention ignores where position ids restart); set trainer.packing=false")
        device = acc.device
        engine = spec(config.rollout.backend)
        # Where the backend's logprobs are not the trainer's own (an engine of its own, or
        # 16-bit numerics), the old logprobs are recomputed and the rollout's become the
        # behaviour policy of a truncated importance weight (verl and TRL do this for vLLM).
        self.recompute = algo_recompute(config, engine.own_weights)
        # Built before sharding, from full weights: the KL reference, and the model rollouts
        # decode with. Under FSDP the latter is a copy of its own where the backend decodes
        # with the trainer's model (hf), and none where it holds its own weights (vLLM).
        self.reference = self._reference_model(model, device)
        self.rollout_model = model
        if self.sharded:
            self.rollout_model = None if engine.own_weights else (
                copy.deepcopy(model).to(device).eval().requires_grad_(False))
        self.policy = ClonePolicy(model if self.rollout_model is None else self.rollout_model,
                                  policy.tokenizer, policy.protocol)
        self.backend = backend or self._build_backend()
        self._follow_leader_version()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=trainer.lr,
                                      betas=tuple(trainer.betas), weight_decay=trainer.weight_decay)
        total_updates = trainer.steps * trainer.optimizer_steps_per_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(trainer.schedule, trainer.warmup_steps, total_updates))
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if self.sharded and self.reference is not None:
            self.reference = shard_frozen(acc, self.reference)
        # After prepare: under FSDP the parameters are new (sharded) tensors.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.state = TrainerState(step=0, epoch=0, cursor=0,
                                  weight_version=self.backend.weight_version)
        if resume_from is not None:
            self.state = load_checkpoint(resume_from, self._unwrapped, self.optimizer,
                                         self.scheduler,
                                         rank=acc.process_index)
            self._publish_weights()
            # The checkpoint's weights are served under the version they had when it was
            # written, so a resumed run numbers its versions as the straight run does.
            self.backend.weight_version = self.state.weight_version
        self.sampler = TaskSampler(self.train_tasks, trainer.seed, self.state.epoch,
                                   self.state.cursor)
        self.logger = None
        if acc.is_main_process:
            self.logger = RunLogger(trainer.output_dir, asdict(config), config.log.wandb,
                                    config.log.wandb_project, config.name, config.log.tensorboard,
                                    resume_step=self.state.step if resume_from is not None
                                    else None)
        self.resumed_from = resume_from
        # trainer.keep_best: the best evaluation so far, on disk, so a resumed run compares
        # against the evaluations made before it stopped too.
        self.best = read_best(trainer.output_dir) if resume_from is not None else None

    # ------------------------------------------------------------------ setup helpers

    @property
    def _unwrapped(self):
        """The training model without its DDP wrapper (under FSDP: the sharded model)."""
        return self.accelerator.unwrap_model(self.model)

    def _build_backend(self):
        rollout = self.config.rollout
        placement = self.placement
        if placement is not None and not placement.is_leader and not spec(
            rollout.backend).whole_node:
            return FollowerBackend()
        # Under the run's mixed precision: an engine's first probe, which calibrates the sync
        # tolerance, is scored as every later one (a no-op in float32).
        with self.accelerator.autocast():
            return build_backend(self.policy, rollout, placement=placement,
                                 collective_timeout_s=self.config.trainer.collective_timeout_s)

    def _publish_weights(self) -> None:
        """Make rollouts use the trained weights (after an update, or a resume)."""
        if self.sharded and self.rollout_model is not None:
            refresh_copy(self.rollout_model, self.model)
        self.backend.sync_weights(self._full_model)
        self._follow_leader_version()

    @property
    def _full_model(self):
        """The model whose forward needs no collective where there is one (the rollout model),
        else the sharded training model (whose every forward is one)."""
        return self._unwrapped if self.rollout_model is None else self.rollout_model

    def _follow_leader_version(self) -> None:
        """With an engine per node, take the weight version the node's engine serves."""
        if self.placement is not None:
            self.backend.weight_version = gather(self.accelerator,
                                                 self.backend.weight_version)[self.placement.leader]

    def _rollout(self, tasks: Sequence[Task], samples_per_task: int,
                 engine: RolloutEngine) -> list[CloneTree]:
        """This process's trees for its share of the step's ``tasks`` (prompt i goes to
        process i % world size), from its own engine or its node's."""
        acc = self.accelerator
        # The run's mixed precision for a backend that decodes with a model of this process
        # (a no-op in float32, and for an engine of its own).
        with acc.autocast():
            if self.placement is None:
                return engine.rollout(tasks[acc.process_index :: acc.num_processes],
                                      samples_per_task)
            return rollout_on_machine(self.placement, tasks, samples_per_task,
                                   lambda mine: engine.rollout(mine, samples_per_task),
                                   self.backend)

    def _reference_model(self, model, device):
        """The KL reference: the base with the adapter disabled (LoRA), else a frozen copy (in
        the compute dtype: it is only read; sharded under FSDP once the model is)."""
        if self.config.algo.loss.kl_coef == 0 or hasattr(model, "disable_adapter"):
            return None
        dtype = next(model.parameters()).dtype if self.accelerator.mixed_precision == "no" else (
            COMPUTE_DTYPES[self.accelerator.mixed_precision])
        return copy.deepcopy(model).to(device, dtype).eval().requires_grad_(False)

    def engine(self, seed: int, sampling: SamplingParams | None = None) -> RolloutEngine:
        """A rollout engine on this trainer's backend, budget and call timeout; sampling as in
        training unless ``sampling`` is given."""
        rollout = self.config.rollout
        sampling = sampling or SamplingParams(rollout.temperature, rollout.top_p, rollout.top_k)
        return RolloutEngine(self.backend, self.policy.protocol, rollout.budget, sampling,
                             seed=seed, call_timeout_s=rollout.call_timeout_s)

    def _step_seed(self, step: int) -> int:
        key = f"{self.config.trainer.seed}:{step}:{self.accelerator.process_index}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[dict[str, float]]:
        """Run until `trainer.steps`; return the metrics of every step run. SIGTERM or SIGINT
        stops it after the step it arrives in, with a checkpoint (`stopped_by` names it)."""
        trainer = self.config.trainer
        history = []
        progress = None
        if self.accelerator.is_main_process and self.config.log.progress:
            progress = tqdm(total=trainer.steps, initial=self.state.step, desc=self.config.name)
        try:
            if trainer.keep_best and self.state.step == 0:
                self._keep_if_best(self.evaluate())  # the starting weights may stay the best
            with StopSignals() as signals:
                while self.state.step < trainer.steps and not self._stop_requested(signals):
                    metrics = self.step()
                    history.append(metrics)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(progress_summary(metrics))
                    if trainer.save_every and self.state.step % trainer.save_every == 0:
                        self.save()
            saved = trainer.save_every and self.state.step % trainer.save_every == 0
            # A run resumed at its last step ran nothing: its checkpoint is already there.
            if (trainer.save_final or self.stopped_by) and not saved and history:
                self.save()
            if trainer.keep_best and not self.stopped_by:
                self._end_with_best()
        finally:
            if progress is not None:
                progress.close()
        return history

    def _stop_requested(self, signals: StopSignals) -> bool:
        """Whether a stop signal reached any process (all of them then stop at this step)."""
        received = gather(self.accelerator, signals.received)
        if any(received):
            self.stopped_by = next(name for name in received if name)
        return self.stopped_by is not None

    def step(self) -> dict[str, float]:
        """One training step (rollout, scoring, update, sync); returns its metrics."""
        trainer, acc = self.config.trainer, self.accelerator
        timings = {}
        start = time.perf_counter()
        tasks = self.sampler.take(trainer.prompts_per_step)
        # A group (all trees of one prompt) lands on one process, which computes its
        # advantages from all its trees; metrics are averaged across processes.
        local = tasks[acc.process_index :: acc.num_processes]
        trees = self._rollout(tasks, trainer.trees_per_prompt,
                              self.engine(self._step_seed(self.state.step)))
        timings["time/rollout"] = time.perf_counter() - start

        mark = time.perf_counter()
        by_id = {t.id: t for t in local}
        self.reward_fn.failures.clear()
        score_trees(trees, by_id, self.reward_fn)
        self._check_rewards(trees)
        credit = self.config.algo.credit
        if CREDIT[credit.strategy].reruns:
            rerun_engine = self.engine(self._step_seed(self.state.step) ^ 0x5EED)
            counterfactual_reruns(trees, by_id, rerun_engine, self.reward_fn, credit)
        timings["time/scoring"] = time.perf_counter() - mark

        mark = time.perf_counter()
        self.backend.sleep()  # free the engine's memory for the update (vLLM sleep mode)
        metrics = self.train_on_trees(trees)
        timings["time/training"] = time.perf_counter() - mark

        mark = time.perf_counter()
        self._publish_weights()
        timings["time/sync"] = time.perf_counter() - mark
        timings.update(sync_metrics(self.backend))

        self.state = TrainerState(self.state.step + 1, self.sampler.epoch, self.sampler.cursor,
                                  self.backend.weight_version)
        timings["time/step"] = time.perf_counter() - start
        metrics.update(self._tree_metrics(trees))
        metrics.update(self._decision_metrics(trees, by_id))
        metrics.update(timings)
        generated = sum_over_processes(self.accelerator,
                                       {"n": sum(t.costs().generated_tokens for t in trees)})["n"]
        metrics["throughput/rollout_tokens_per_s"] = generated / max(timings["time/rollout"], 1e-9)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        if trainer.eval_every and self.state.step % trainer.eval_every == 0 and self.eval_tasks:
            metrics.update(self.evaluate())
            if trainer.keep_best:
                self._keep_if_best(metrics)
        self._log(metrics, trees)
        return metrics

    def _check_rewards(self, trees: Sequence[CloneTree]) -> None:
        """Warn about the trees whose reward failed (scored 0 by `GuardedReward`); stop the run
        if that is every tree of the step, on every process: nothing could be learned."""
        failures = self.reward_fn.failures
        counts = sum_over_processes(self.accelerator,
                                    {"failed": len(failures), "trees": len(trees)})
        if not counts["failed"]:
            return
        first = failures[0] if failures else "on another process"
        step = self.state.step + 1
        if counts["failed"] == counts["trees"]:
            raise RunError(f"step {step}: the reward failed on every tree ({first}); nothing can "
                           "be learned "
                           f"from rewards that all fail: fix task.reward={self.config.task.reward}")
        logger.warning("step %d: the reward failed on %d of %d trees, scored 0 (first: %s)",
                       step, counts["failed"], counts["trees"], first)

    # ------------------------------------------------------------------ the update

    def train_on_trees(self, trees: Sequence[CloneTree]) -> dict[str, float]:
        """Advantages, samples and `optimizer_steps_per_step` updates on scored trees. Trees
        sampled with NaN logprobs (weights that blew up) are not trained on: the whole update
        counts as one non-finite update (`_count_nonfinite`)."""
        config = self.config
        broken = sum_over_processes(self.accelerator, {"n": sum(map(_nan_logprobs, trees))})["n"]
        if broken:
            self._count_nonfinite(f"{broken:.0f} trees sampled with NaN logprobs")
            return {"train/optimizer_steps": 0, "train/nonfinite_skipped": 1}
        advantages = compute_advantages(trees, config.algo.credit)
        samples = samples_from_trees(trees, advantages)
        samples, stale = self._handle_stale(samples)
        metrics = mean_over_processes(self.accelerator, advantages.metrics)
        metrics["samples/stale_refused"] = sum_over_processes(self.accelerator, {"n": stale})["n"]
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
        # Packed rows are as wide as the longest sample; unpacked, each sample is a row.
        if trainer.packing:
            width = packing_width(lengths, trainer.tokens_per_micro_batch)
            micro = packed_micro_batches(lengths, trainer.tokens_per_micro_batch)
        else:
            width = None
            # Where the update runs a shared prompt once, cutting a group apart costs its prompt.
            prompts = [s.prompt for s in samples] if self.share_prompts else None
            micro = make_micro_batches(lengths, trainer.tokens_per_micro_batch,
                                       pass_overhead_tokens=trainer.pass_overhead_tokens,
                                       prompts=prompts)
        timer = PhaseTimer(self.accelerator.device)
        trainable = [s.num_trainable for s in samples]
        plan = split_for_optimizer_steps(micro, trainer.optimizer_steps_per_step, trainable)
        algo = self.config.algo
        # Kept stale samples need old logprobs under the current weights: the truncated
        # importance weight compares them with the logprobs the tokens were sampled under.
        recompute = self.recompute or algo.stale_samples == "correct"
        proximal = self._proximal_logprobs(samples, micro, width) if recompute else None
        # Tree ids made unique across processes for tree_mean aggregation.
        tree_ids = [s.tree_id * acc.num_processes + acc.process_index for s in samples]
        stats, grad_norms, trained_tokens, updates, skipped = [], [], 0, 0, 0
        start = time.perf_counter()
        self.model.train()
        for step_batches in plan:
            members = [i for batch in step_batches for i in batch]
            weights, total = global_weights(acc, [trainable[i] for i in members],
                                            [tree_ids[i] for i in members],
                                            self.config.algo.loss.aggregation)
            if total == 0:
                # No process has a token to learn from: skip the update entirely (an AdamW
                # step on zero gradients would still move the weights by its momentum).
                continue
            weight_of = dict(zip(members, weights))
            batches = step_batches or [[]]  # a process without samples still joins the all-reduce
            if self.sharded:
                # Every forward and backward is a collective under FSDP: all processes run as
                # many micro-batches, the ones with fewer padded with empty ones.
                batches += [[]] * (max(gather(acc, len(batches))) - len(batches))
            for j, batch in enumerate(batches):
                sync = j == len(batches) - 1
                with contextlib.nullcontext() if sync else acc.no_sync(self.model):
                    rows = [samples[i] for i in batch]
                    old = [proximal[i] for i in batch] if proximal is not None else None
                    stats.append(self._backward(rows, [weight_of[i] for i in batch], old, width,
                                                timer))
                    trained_tokens += sum(samples[i].length for i in batch)
            with timer("optimizer"):
                norm = self._optimizer_step()
            if norm is None:
                skipped += 1
                continue
            if trainer.max_grad_norm:
                grad_norms.append(norm)
            updates += 1
        elapsed = time.perf_counter() - start
        counted = [s for s in stats if s["tokens"]]
        local = ({f"loss/{k}": v for k, v in combine_stats(counted).items() if k != "tokens"}
                 if counted else {})
        metrics = mean_over_processes(self.accelerator, local)
        metrics.update(sum_over_processes(self.accelerator, {
            "train/samples": len(samples),
            "train/trainable_tokens": sum(trainable),
            "train/micro_batches": len(micro),
            "throughput/train_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
        }))
        metrics.update(mean_over_processes(self.accelerator, {
            "train/padding_frac": padding_fraction(lengths, micro, width), **timer.metrics()}))
        metrics["train/optimizer_steps"] = updates
        metrics["train/grad_norm"] = statistics.fmean(grad_norms) if grad_norms else 0.0
        if skipped:
            metrics["train/nonfinite_skipped"] = skipped
        if proximal is not None:
            metrics.update(self._logprob_gap(samples, proximal))
        return metrics

    def _optimizer_step(self) -> float | None:
        """Clip and apply the accumulated gradients; return their norm, or None when the loss
        or the gradients were not finite: then the update is skipped as one without tokens
        is (weights, optimizer and schedule stay), and `trainer.max_nonfinite_updates` of
        those in a row stop the run."""
        trainer = self.config.trainer
        # Clipping at infinity scales by exactly 1: the norm of an unclipped run, same bits.
        norm = self.accelerator.clip_grad_norm_(self.params, trainer.max_grad_norm or math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        finite = math.isfinite(norm)  # a non-finite loss gives non-finite gradients too
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.nonfinite_in_row = 0
        self.optimizer.zero_grad(set_to_none=True)
        if not finite:
            self._count_nonfinite(f"gradient norm {norm}")
        return norm if finite else None

    def _count_nonfinite(self, what: str) -> None:
        """One more update skipped in a row for a non-finite loss, gradient or policy; at
        `trainer.max_nonfinite_updates` in a row, stop the run."""
        trainer = self.config.trainer
        self.nonfinite_in_row += 1
        logger.warning("step %d: update skipped: %s", self.state.step + 1, what)
        if self.nonfinite_in_row >= trainer.max_nonfinite_updates:
            latest = list_checkpoints(trainer.output_dir)
            raise RunError(
                f"step {self.state.step + 1}: {self.nonfinite_in_row} updates in a row were "
                "skipped for a "
                f"non-finite loss, gradient or policy (last: {what}; "
                "trainer.max_nonfinite_updates); the "
                f"learning rate (trainer.lr={trainer.lr:g}) may be too high. Last checkpoint: "
                f"{latest[-1] if latest else 'none'}")

    def _logprob_gap(self, samples: list[TrainingSample],
                     proximal: list[torch.Tensor]) -> dict[str, float]:
        """How far the rollout's logprobs of the sampled tokens are from the trainer's: mean and
        largest |difference| over every process's trained tokens."""
        total, count, largest = 0.0, 0, 0.0
        for sample, values in zip(samples, proximal):
            mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
            gap = (values[mask] - torch.tensor(sample.old_logprobs)[mask]).abs()
            total, count = total + gap.sum().item(), count + gap.numel()
            largest = max(largest, gap.max().item()) if gap.numel() else largest
        parts = gather(self.accelerator, (total, count, largest))
        counted = sum(c for _, c, _ in parts)
        return {"rollout/logprob_diff_mean": sum(t for t, _, _ in parts) / max(counted, 1),
                "rollout/logprob_diff_max": max(m for _, _, m in parts)}

    @torch.no_grad()
    def _proximal_logprobs(self, samples: list[TrainingSample], micro: list[list[int]],
                           width: int | None) -> list[torch.Tensor]:
        """Logprobs of every sample under the current weights, once, before any update: the
        proximal policy of decoupled PPO (the sampled logprobs become behaviour logprobs).
        The rollout model holds exactly those weights and needs no collective; without one
        (FSDP with vLLM) the sharded model runs, as many passes on every process."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        model = self._full_model
        model.eval()
        for batch in self._every_process_alike(micro):
            if not batch:
                self._empty_pass(model)
                continue
            rows = [samples[i] for i in batch]
            mb = collate(rows, [0.0] * len(rows), self.policy.tokenizer.pad_token_id,
                         width).to(self.accelerator.device)
            logp, _, _ = self._logprobs(model, mb)
            for i, values in zip(batch, mb.per_sample(logp)):
                out[i] = values.float().cpu()
        return out

    def _every_process_alike(self, batches: list[list[int]]) -> list[list[int]]:
        """``batches``, padded with empty ones to the most any process has when the model's
        forward passes are collectives (sharded, with no full copy to run instead)."""
        if self.rollout_model is not None or not self.sharded:
            return batches
        return batches + [[]] * (max(gather(self.accelerator, len(batches))) - len(batches))

    def _empty_pass(self, model) -> torch.Tensor:
        """A one-token forward that only takes part in the collectives of the others' passes."""
        dummy = torch.full((1, 1), self.policy.tokenizer.pad_token_id,
                           device=self.accelerator.device)
        return model(input_ids=dummy).logits

    def _logprobs(self, model, mb, entropy: bool = False, decision: bool = False):
        """Input-aligned logprobs of the sampling distribution (logits / temperature) from the
        micro-batch's first sampled token on; if asked, the entropy of each position's
        distribution, and the binary entropy of the spawn-open token on the roots' decision
        tokens (`token_choice_entropy`); None for what was not asked. Under the run's mixed
        precision whatever the model: a rollout copy or a KL reference computes as the
        trained model does (a no-op in float32)."""
        first = mb.first_trained_position()
        with self.accelerator.autocast():
            logp, logits = forward_logprobs(model, mb.input_ids, mb.attention_mask,
                                            self.config.rollout.temperature or 1.0,
                                            position_ids=mb.position_ids, from_position=first,
                                            share_prefix=self.share_prompts)
        skipped = logp.shape[1] - logits.shape[1]  # the columns the logits start after
        full = left_pad(token_entropy(logits), skipped) if entropy else None
        choice = None
        if decision:
            choice = left_pad(token_choice_entropy(logits, self.policy.protocol.spawn_open_id,
                                                   mb.decision_mask[:, skipped:]), skipped)
        return logp, full, choice

    def _backward(self, batch: list[TrainingSample], weights: list[float], proximal,
                  width: int | None, timer: PhaseTimer) -> dict[str, float]:
        loss_config = self.config.algo.loss
        if not batch:
            # Nothing to learn on this process, but the others all-reduce gradients: take part
            # with a zero loss through a real forward pass (DDP needs its hooks to fire), and in
            # a reference pass where that is a collective too.
            if loss_config.kl_coef > 0 and self._reference_is_collective:
                with torch.no_grad(), self._reference_context():
                    self._empty_pass(self.reference if self.reference is not None
                                     else self._full_model)
            self.accelerator.backward(self._empty_pass(self.model).sum() * 0.0)
            return {"tokens": 0}
        mb = collate(batch, weights, self.policy.tokenizer.pad_token_id,
                     width).to(self.accelerator.device)
        ref = None
        if loss_config.kl_coef > 0:
            with timer("reference"):
                ref = self._reference_logprobs(mb)
        with timer("forward"):
            logp, entropy, decision = self._logprobs(self.model, mb,
                                                     entropy=loss_config.entropy_coef > 0,
                                                     decision=loss_config.decision_entropy_coef > 0)
            old, behaviour = mb.old_logprobs, None
            if proximal is not None:
                old, behaviour = mb.place(proximal), mb.old_logprobs
            loss_per_token, stats = per_token_loss(logp, old, mb.advantages, mb.loss_mask,
                                                   loss_config,
                                                   ref_logprobs=ref, entropy=entropy,
                                                   behaviour_logprobs=behaviour,
                                                   decision_entropy=decision)
            if decision is not None and mb.decision_mask.any():
                stats["decision_entropy"] = float(decision.detach()[mb.decision_mask.bool()].mean())
        with timer("backward"):
            self.accelerator.backward((loss_per_token * mb.token_weights).sum())
        return stats

    @torch.no_grad()
    def _reference_logprobs(self, mb) -> torch.Tensor:
        """Logprobs under the KL reference: a frozen copy, or the base with LoRA disabled."""
        if self.reference is not None:
            return self._logprobs(self.reference, mb)[0]
        with self._reference_context():
            return self._logprobs(self._full_model, mb)[0]

    def _reference_context(self):
        """The adapter disabled for a LoRA reference pass (nothing to do for a frozen copy)."""
        return (contextlib.nullcontext() if self.reference is not None
                else self._full_model.disable_adapter())

    @property
    def _reference_is_collective(self) -> bool:
        """Whether a reference pass is a collective: a sharded copy, or LoRA's base through
        the sharded model."""
        return self.sharded and (self.reference is not None or self.rollout_model is None)

    # ------------------------------------------------------------------ evaluation and logs

    def evaluate(self, tasks: Sequence[Task] | None = None) -> dict[str, float]:
        """Rollouts of the held-out tasks (one greedy tree each, or ``trainer.eval_samples``
        sampled as in training): mean reward, accuracy and costs."""
        tasks = list(tasks if tasks is not None else self.eval_tasks)
        local = tasks[self.accelerator.process_index :: self.accelerator.num_processes]
        samples = self.config.trainer.eval_samples
        # One seed for every evaluation: the draws are shared, so evaluations differ by weights.
        engine = self.engine(self.config.trainer.seed,
                             None if samples else SamplingParams(temperature=0))
        trees = self._rollout(tasks, samples or 1, engine)
        score_trees(trees, local, self.reward_fn)
        return {f"eval/{k}": v for k, v in self._tree_metrics(trees).items()}

    def _keep_if_best(self, metrics: dict[str, float]) -> None:
        """Save the current weights (`save_best`) when ``metrics`` holds the best value of
        ``trainer.keep_best`` so far (strictly: the earliest of equal values stays); every
        process sees the same gathered metrics, so all agree."""
        name = self.config.trainer.keep_best
        if name not in metrics:
            known = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
            raise ConfigError(f"trainer.keep_best={name!r} is not an evaluation metric; this "
                              f"run's are {known}")
        value = metrics[name]
        if self.accelerator.is_main_process:  # every evaluation, for reports
            log_evaluation(self.config.trainer.output_dir, self.state.step, value)
        if self.best is not None and not value > self.best["value"]:
            return
        acc = self.accelerator
        folder = save_best(self.config.trainer.output_dir, self.state, self._unwrapped, value,
                           rank=acc.process_index, world_size=acc.num_processes,
                           config=asdict(self.config))
        self.best = {"step": self.state.step, "value": value, "folder": folder}

    def _end_with_best(self) -> None:
        """Load the best evaluated weights (`trainer.keep_best`) into the model and serve them."""
        if self.best is None or self.best["step"] == self.state.step:
            return
        load_checkpoint(self.best["folder"], self._unwrapped, rank=self.accelerator.process_index)
        self._publish_weights()
        logger.info("ending with the weights of step %d (%s %.4f), the best evaluated",
                    self.best["step"], self.config.trainer.keep_best, self.best["value"])

    def _tree_metrics(self, trees: Sequence[CloneTree]) -> dict[str, float]:
        """`tree_metrics` of every tree of every process, averaged; a key a tree does not
        report counts 0 for it (a reward diagnostic not raised), so each is a rate."""
        everything = [row for part in gather(self.accelerator, [tree_metrics(t) for t in trees])
                      for row in part]
        if not everything:
            return {}
        keys = sorted({key for row in everything for key in row})
        metrics = {key: statistics.fmean(r.get(key, 0.0) for r in everything) for key in keys}
        metrics["reward/std"] = statistics.pstdev(r["reward/mean"] for r in everything)
        return metrics

    def _decision_metrics(self, trees: Sequence[CloneTree],
                          tasks: dict[str, Task]) -> dict[str, float]:
        """How often the roots' first turn opens a spawn call, over every process's trees:
        ``decision/p_delegate``, and per task size (its number of context keys)
        ``decision/p_delegate/size_<k>``, so a run shows its decision being learned size by
        size. Empty for a protocol without spawn calls."""
        protocol = self.policy.protocol
        if not protocol.has_spawn_calls:
            return {}
        mine = [(len(tasks[t.task_id].context), protocol.spawn_open_id in t.root.first_turn_ids())
                for t in trees]
        rows = [row for part in gather(self.accelerator, mine) for row in part]
        if not rows:
            return {}
        metrics = {"decision/p_delegate": statistics.fmean(d for _, d in rows)}
        for size in sorted({size for size, _ in rows}):
            metrics[f"decision/p_delegate/size_{size}"] = statistics.fmean(
                d for k, d in rows if k == size)
        return metrics

    def _log(self, metrics: dict[str, float], trees: Sequence[CloneTree]) -> None:
        if self.logger is None:
            return
        self.logger.log(self.state.step, metrics)
        every = self.config.log.trees_every
        if every and self.state.step % every == 0:
            self.logger.save_trees(self.state.step, list(trees)[: self.config.log.trees_per_save])

    def save(self) -> Path:
        """A checkpoint of the current state (`save_checkpoint`); weights that are not finite
        are never saved."""
        acc = self.accelerator
        bad = [name for name, p in self._unwrapped.named_parameters()
               # a shard under FSDP
               if not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()]
        if any(gather(acc, bad)):
            raise RunError(f"not saving step {self.state.step}: parameters are not finite "
                           f"({', '.join(bad[:3]) or 'on another process'}); the last checkpoint "
                           "is kept")
        return save_checkpoint(self.config.trainer.output_dir, self.state, self._unwrapped,
                               self.optimizer, self.scheduler, rank=acc.process_index,
                               world_size=acc.num_processes,
                               keep=self.config.trainer.keep_checkpoints,
                               config=asdict(self.config))

    def close(self) -> None:
        """Release the backend and the reward's worker, close the logs and give the output
        folder's lock back."""
        self.backend.close()
        self.reward_fn.close()
        if self.logger is not None:
            self.logger.close()
        if self.lock is not None:
            self.lock.release()
