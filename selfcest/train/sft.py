"""Supervised warm start on protocol traces (CLI: selfcest-sft).

Every node of every demonstration tree becomes one sequence: its full context, with the
loss on the tokens the node itself "sampled" (its own turns) and none on the prompt or on
injected returns and notices. The same code warm-starts a tiny model from scratch or a
pretrained one on a protocol it has not seen.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfcest.algo.advantages import Advantages
from selfcest.algo.losses import token_logprobs
from selfcest.policy import ClonePolicy
from selfcest.train.batching import TrainingSample, collate, make_micro_batches, samples_from_trees
from selfcest.tree import CloneTree


@dataclass
class SFTConfig:
    """Supervised training settings; batch units are tokens."""

    # Optimizer steps.
    steps: int = 300
    # Sequences per optimizer step, drawn without replacement (reshuffled every epoch).
    sequences_per_step: int = 64
    # Padded tokens one micro-batch may hold (gradients accumulate over micro-batches).
    tokens_per_micro_batch: int = 8192
    # AdamW learning rate (peak), warmup steps, then cosine decay to 10% of the peak.
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    # Gradient-norm clip (0 = off).
    max_grad_norm: float = 1.0
    seed: int = 0


def sft_samples(trees: Sequence[CloneTree]) -> list[TrainingSample]:
    """One sample per node with sampled tokens; advantage 1 (plain likelihood)."""
    ones = Advantages(
        per_tree=[{node_id: 1.0 for node_id in tree.nodes} for tree in trees],
        keep=[True] * len(trees),
        metrics={},
    )
    return samples_from_trees(trees, ones)


def train_sft(
    policy: ClonePolicy,
    trees: Sequence[CloneTree],
    config: SFTConfig,
    log=None,
) -> list[dict[str, float]]:
    """Fit ``policy`` to the demonstration ``trees``; returns per-step metrics.

    ``log(step, metrics)`` is called after each step when given.
    """
    samples = sft_samples(trees)
    if not samples:
        raise ValueError("no demonstration tokens to train on")
    model = policy.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)

    def schedule(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    device = next(model.parameters()).device
    order: list[int] = []
    rng = random.Random(config.seed)
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
            mb = collate(rows, [1.0 / tokens] * len(rows), policy.tokenizer.pad_token_id).to(device)
            positions = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                           position_ids=positions).logits
            loss = -(token_logprobs(logits, mb.input_ids) * mb.token_weights).sum()
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


def warm_start(policy: ClonePolicy, config, log=None) -> list[dict[str, float]]:
    """Build the demonstrations a `WarmStartConfig` describes and fit ``policy`` to them."""
    from selfcest.train.traces import demonstrations

    trees = demonstrations(config.tasks, config.teacher, dict(config.teacher_params),
                           policy.protocol, config.budget, config.delegator_repeat)
    return train_sft(policy, trees, config.sft, log=log)
