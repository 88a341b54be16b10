"""Supervised warm start on protocol traces (CLI: selfcest-sft).

Every node of every demonstration tree becomes one sequence: its full context, with the
loss on the tokens the node itself "sampled" (its own turns) and none on the prompt or on
injected returns and notices. A turn the engine rejected with a notice (a malformed spawn
call in a repair demonstration) gets no loss either: it is context the model learns to
recover from, not an example to imitate. The same code warm-starts a tiny model from scratch
or a pretrained one on a protocol it has not seen.

The defaults take many small steps, which is what the tiny models of the CPU reproduction
need (``docs/cpu_reproduction.md``, "The warm start").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from selfcest.algo.advantages import Advantages
from selfcest.configure import require, setting
from selfcest.modeling import forward_logprobs
from selfcest.policy import ClonePolicy
from selfcest.train.batching import (
    MicroBatch,
    TrainingSample,
    collate,
    make_micro_batches,
    samples_from_trees,
)
from selfcest.train.schedule import lr_lambda
from selfcest.tree import CloneTree, Node


@dataclass
class SFTConfig:
    """Supervised training settings; batch units are sequences (one per node) and tokens."""

    steps: int = setting(1500, help="optimizer steps")
    sequences_per_step: int = setting(16, help="sequences per optimizer step, drawn without "
                                               "replacement (reshuffled every epoch)")
    tokens_per_micro_batch: int = setting(8192, help="padded tokens one micro-batch may hold "
                                                     "(gradients accumulate over micro-batches)")
    lr: float = setting(3e-3, help="AdamW peak learning rate: linear warmup, then cosine decay to "
                                   "final_lr_fraction of it")
    warmup_steps: int = setting(20, help="linear warmup, in optimizer steps")
    final_lr_fraction: float = setting(0.1, help="the learning rate at the last step, as a "
                                                 "fraction of the peak")
    weight_decay: float = setting(0.0, help="AdamW weight decay")
    max_grad_norm: float = setting(1.0, help="gradient-norm clip (0 = off)")
    spawner_repeats: int = setting(1, help=(
        "times each node that spawned clones appears per epoch (1 = as often as any node): those "
        "nodes do the rarest job of a tree, adding their clones' answers"))
    seed: int = setting(0, help="seed of the sequence order")
    validate_every: int = setting(0, help=(
        "steps between validations when the caller gives a validation score (0: none): the "
        "weights of the best-scoring validation are kept, and training stops once a score "
        "reaches validation_target, so every machine ends at a checkpoint of similar skill "
        "rather than wherever its float rounding led the last step"))
    validation_target: float = setting(1.0, help="a validation score that ends training early "
                                                 "(1.0: only a perfect score does)")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for name in ("steps", "sequences_per_step", "tokens_per_micro_batch", "spawner_repeats"):
            require(getattr(self, name) >= 1, name, f"must be >= 1; got {getattr(self, name)}")
        require(self.validate_every >= 0, "validate_every",
                f"must be >= 0; got {self.validate_every}")
        require(self.lr > 0, "lr", f"must be > 0; got {self.lr}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0; got {self.warmup_steps}")
        require(0 <= self.final_lr_fraction <= 1, "final_lr_fraction",
                f"must be in [0, 1]; got {self.final_lr_fraction}")


def sft_samples(trees: Sequence[CloneTree], spawner_repeats: int = 1) -> list[TrainingSample]:
    """One sample per node with sampled tokens, advantage 1 (plain likelihood), no loss on
    the turns the engine rejected (`rejected_positions`); a node that made a spawn call is
    listed ``spawner_repeats`` times."""
    ones = Advantages(
        per_tree=[{node_id: 1.0 for node_id in tree.nodes} for tree in trees],
        keep=[True] * len(trees),
        metrics={},
    )
    samples = []
    for sample in samples_from_trees(trees, ones):
        node = trees[sample.tree_id].nodes[sample.node_id]
        for position in rejected_positions(node):
            sample.loss_mask[position] = 0
        if sample.num_trainable:  # a node whose every turn was rejected teaches nothing
            samples += [sample] * (spawner_repeats if node.spawns else 1)
    return samples


def rejected_positions(node: Node) -> list[int]:
    """Positions in the node's context (prompt first) of the sampled tokens of every turn
    the engine answered with a notice: the turn's segments since the last injected one."""
    rejected, turn = [], []
    position = len(node.prompt_ids)
    for segment in node.segments:
        span = range(position, position + len(segment.token_ids))
        if segment.kind == "notice":
            rejected += turn
        if segment.kind in ("notice", "return"):
            turn = []
        elif segment.trainable:
            turn += span
        position = span.stop
    return rejected


def sft_loss(model, batch: MicroBatch) -> torch.Tensor:
    """Negative log-likelihood of the sampled tokens, weighted by ``batch.token_weights``
    (zero on prompt, return, notice and padding tokens, so those never get a gradient)."""
    logprobs = forward_logprobs(model, batch.input_ids, batch.attention_mask,
                                position_ids=batch.position_ids,
                                from_position=batch.first_trained_position())[0]
    return -(logprobs * batch.token_weights).sum()


def train_sft(
    policy: ClonePolicy,
    trees: Sequence[CloneTree],
    config: SFTConfig,
    log: Callable[[int, dict[str, float]], None] | None = None,
    score: Callable[[ClonePolicy], float] | None = None,
) -> list[dict[str, float]]:
    """Fit ``policy`` to the demonstration ``trees``; returns per-step metrics.

    Each step's loss is the mean over the step's sampled tokens. ``log(step, metrics)`` is
    called after each step when given. With ``score`` (higher is better) and
    ``config.validate_every``, the policy is scored every that many steps and at the last
    (``sft/validation`` in that step's metrics); it ends with the best-scoring weights, and
    training stops at the first score that reaches ``config.validation_target``. The model
    is left in eval mode.
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
    best: tuple[float, dict[str, torch.Tensor]] | None = None
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
        done = False
        if score is not None and config.validate_every and (
                (step + 1) % config.validate_every == 0 or step + 1 == config.steps):
            model.eval()
            metrics["sft/validation"] = value = float(score(policy))
            model.train()
            if best is None or value > best[0]:
                best = (value, {k: v.detach().clone() for k, v in model.state_dict().items()})
            done = value >= config.validation_target
        if log is not None:
            log(step + 1, metrics)
        if done:
            break
    if best is not None:
        model.load_state_dict(best[1])
    model.eval()
    return history
