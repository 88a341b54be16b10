"""Supervised warm start on protocol traces (CLI: selfcest-sft).

Every node of every demonstration tree becomes one sequence: its full context, with the
loss on the tokens the node itself "sampled" (its own turns) and none on the prompt or on
injected returns and notices. The same code warm-starts a tiny model from scratch or a
pretrained one on a protocol it has not seen.

For the tiny models of the CPU experiment, optimizer steps matter more than tokens per
step: the skills a demonstration teaches (reading the k-th number of a list, adding a digit
to a running total) appear after a few hundred updates, whatever the batch (measured: 2000
steps of 16 sequences beat 500 steps of 64), so the defaults take many small steps.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from selfcest.algo.advantages import Advantages
from selfcest.policy import ClonePolicy
from selfcest.train.batching import (
    MicroBatch,
    TrainingSample,
    collate,
    forward_logprobs,
    make_micro_batches,
    samples_from_trees,
)
from selfcest.train.schedule import lr_lambda
from selfcest.tasks.base import Task
from selfcest.tree import CloneTree


@dataclass
class SFTConfig:
    """Supervised training settings; batch units are sequences (one per node) and tokens."""

    # Optimizer steps.
    steps: int = 1500
    # Sequences per optimizer step, drawn without replacement (reshuffled every epoch).
    sequences_per_step: int = 16
    # Padded tokens one micro-batch may hold (gradients accumulate over micro-batches).
    tokens_per_micro_batch: int = 8192
    # AdamW peak learning rate; linear warmup over `warmup_steps`, then cosine decay to
    # `final_lr_fraction` of the peak at the last step.
    lr: float = 3e-3
    warmup_steps: int = 20
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    # Gradient-norm clip (0 = off).
    max_grad_norm: float = 1.0
    # Times each node that spawned clones appears per epoch (1 = as often as any node).
    # Those nodes do the rarest job of a tree, adding their clones' answers; leaves, which
    # outnumber them, learn their job long before.
    spawner_repeats: int = 1
    # Seed of the sequence order.
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "sequences_per_step", "tokens_per_micro_batch", "spawner_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.final_lr_fraction <= 1:
            raise ValueError("sft.lr must be > 0, warmup_steps >= 0, final_lr_fraction in [0, 1]")


def sft_samples(trees: Sequence[CloneTree], spawner_repeats: int = 1) -> list[TrainingSample]:
    """One sample per node with sampled tokens, advantage 1 (plain likelihood); a node that
    spawned clones is listed ``spawner_repeats`` times."""
    ones = Advantages(
        per_tree=[{node_id: 1.0 for node_id in tree.nodes} for tree in trees],
        keep=[True] * len(trees),
        metrics={},
    )
    samples = []
    for sample in samples_from_trees(trees, ones):
        spawned = bool(trees[sample.tree_id].nodes[sample.node_id].spawns)
        samples += [sample] * (spawner_repeats if spawned else 1)
    return samples


def sft_loss(model, batch: MicroBatch) -> torch.Tensor:
    """Negative log-likelihood of the sampled tokens, weighted by ``batch.token_weights``
    (zero on prompt, return, notice and padding tokens, so those never get a gradient)."""
    return -(forward_logprobs(model, batch)[0] * batch.token_weights).sum()


def train_sft(
    policy: ClonePolicy,
    trees: Sequence[CloneTree],
    config: SFTConfig,
    log: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Fit ``policy`` to the demonstration ``trees``; returns per-step metrics.

    Each step's loss is the mean over the step's sampled tokens. ``log(step, metrics)`` is
    called after each step when given. The model is left in eval mode.
    """
    samples = sft_samples(trees, config.spawner_repeats)
    if not samples:
        raise ValueError("no demonstration tokens to train on")
    model = policy.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda("cosine", config.warmup_steps, config.steps, config.final_lr_fraction))
    device = next(model.parameters()).device
    pad_id = policy.tokenizer.pad_token_id
    rng = random.Random(config.seed)
    order: list[int] = []
    history = []
    model.train()
    for step in range(config.steps):
        start = time.perf_counter()
        batch = []
        while len(batch) < min(config.sequences_per_step, len(samples)):
            if not order:
                order = list(range(len(samples)))
                rng.shuffle(order)
            batch.append(samples[order.pop()])
        tokens = sum(s.num_trainable for s in batch)
        total_loss = 0.0
        for micro in make_micro_batches([s.length for s in batch], config.tokens_per_micro_batch):
            rows = [batch[i] for i in micro]
            loss = sft_loss(model, collate(rows, [1.0 / tokens] * len(rows), pad_id).to(device))
            loss.backward()
            total_loss += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = {"sft/loss": total_loss, "sft/grad_norm": float(grad_norm),
                   "sft/tokens": float(tokens), "sft/lr": scheduler.get_last_lr()[0],
                   "time/step": time.perf_counter() - start}
        history.append(metrics)
        if log is not None:
            log(step + 1, metrics)
    model.eval()
    return history


def warm_start(
    policy: ClonePolicy,
    config,
    exclude: Sequence[Task] = (),
    log: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Build the demonstrations the ``warm_start`` section of a `TrainConfig` describes
    (leaving out any task of ``exclude``) and fit ``policy`` to them; returns per-step
    metrics."""
    from selfcest.train.traces import demonstrations

    section = config.warm_start
    trees = demonstrations(section.tasks, section.teacher, section.teacher_params, policy.protocol,
                           section.budget or config.rollout.budget, exclude)
    return train_sft(policy, trees, section.sft, log=log)


def logged_warm_start(policy: ClonePolicy, config, folder: Path) -> list[dict[str, float]]:
    """`warm_start` leaving out the config's held-out tasks, with its loss curve written to
    ``folder/sft.jsonl`` (one JSON line per step); returns the per-step metrics."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sft.jsonl", "w") as log:
        return warm_start(policy, config, held_out_tasks(config),
                          log=lambda step, m: log.write(json.dumps({"step": step, **m}) + "\n"))


def run_warm_start(config) -> Path:
    """``selfcest-sft``: validate a `TrainConfig`, warm-start its model as its ``warm_start``
    section says (leaving out its evaluation tasks), and save the policy and the loss curve
    (``sft.jsonl``) under ``<trainer.output_dir>/sft``; returns that folder."""
    from selfcest.train.config import ConfigError, validate
    from selfcest.train.trainer import build_policy

    validate(config)
    if not config.warm_start.tasks:
        raise ConfigError("warm_start.tasks is empty: give a task source for the teacher to demonstrate")
    out = Path(config.trainer.output_dir) / "sft"
    if config.trainer.cpu_threads:
        torch.set_num_threads(config.trainer.cpu_threads)
    policy = build_policy(config)
    logged_warm_start(policy, config, out)
    policy.save_pretrained(out)
    return out


def held_out_tasks(config) -> list[Task]:
    """A `TrainConfig`'s held-out tasks, which a warm start must not demonstrate: its
    evaluation split (``task.params`` updated by ``task.eval_params``; none when that is empty,
    as the evaluation then reads the training split) and its OOD split (``task.ood_params``)."""
    from selfcest.train.config import held_out_splits, load_split  # config imports this module

    return [held for split in held_out_splits(config.task) for held in load_split(config.task, split)]
