"""Training-step efficiency: phase split of real GRPO steps, and the update against its
practical limit.

1. A few `GRPOTrainer` steps on keyed_sum: time per phase (rollout, scoring, training,
   sync), tokens/s, padding fraction.
2. The update alone on a realistic set of clone trees (teacher demonstrations: roots with
   several clones each, so lengths vary) under three batchings (one sample per row, cut for
   a pass overhead of 512 or 32 tokens; packed rows), and a plain forward+backward over the
   same tokens packed into full rows without masks (the practical limit on this hardware),
   measured in the same run, alternating, best of several repeats.

    python benchmarks/train_step.py [--sizes tiny medium] [--repeats 5]

Reports ratios, not absolute speeds: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from selfcest.budget import Budget
from selfcest.policy import ClonePolicy
from selfcest.rewards.base import RewardResult
from selfcest.tasks import load_tasks
from selfcest.tasks.keyed_sum_teacher import KeyedSumTeacher
from selfcest.train.config import TrainConfig
from selfcest.train.setup import build_trainer
from selfcest.train.traces import teacher_trees
from selfcest.train.trainer import GRPOTrainer


def trainer_for(size: str, output_dir: str) -> GRPOTrainer:
    config = TrainConfig()
    config.model.name = size
    config.task.params = {"split": "train", "n_train": 256, "n_test": 8, "n_ood": 8}
    config.task.reward_params = {"cost": None}
    config.rollout.budget = Budget(node_generation=64, tree_generation=256, node_context=512)
    config.trainer.prompts_per_step = 8
    config.trainer.trees_per_prompt = 4
    config.trainer.tokens_per_micro_batch = 8192
    config.trainer.pass_overhead_tokens = 32  # as configs/trainer/cpu.yaml
    config.trainer.output_dir = output_dir
    config.log.progress = False
    return build_trainer(config, reward_fn=length_reward)


def length_reward(tree, task) -> RewardResult:
    """Share of the generation budget used: varies under any policy, so every step trains."""
    return RewardResult(score=tree.costs().generated_tokens / 256,
                        correct=tree.answer == task.answer)


def phase_split(trainer: GRPOTrainer, steps: int) -> dict[str, float]:
    rows = [trainer.step() for _ in range(steps)]
    keys = ["time/rollout", "time/scoring", "time/training", "time/sync", "time/step",
            "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s",
            "train/padding_frac"]
    return {k: statistics.fmean(r[k] for r in rows) for k in keys}


def demonstration_trees(policy: ClonePolicy, n: int, weight_version: int):
    tasks = load_tasks("keyed_sum", split="train", n_train=n, n_test=1, n_ood=1,
                       train={"num_keys": 4, "list_len": 3, "max_value": 3})
    trees = teacher_trees(tasks, KeyedSumTeacher(redelegate=0.5, seed=0), policy.protocol,
                          Budget(max_depth=3, node_generation=128, tree_generation=1024))
    rng = random.Random(0)
    for i, tree in enumerate(trees):
        tree.task_index = i // 4  # groups of four trees, as with 4 trees per prompt
        tree.reward, tree.correct = rng.random(), False
        tree.info["malformed_nodes"] = []
        tree.weight_version = weight_version  # as if sampled from the current weights
        for node in tree.nodes.values():
            node.weight_version = weight_version
            for segment in node.segments:
                if segment.trainable:  # plausible sampling logprobs, so the ratio is ~1
                    segment.logprobs = [-1.0] * len(segment.token_ids)
    return trees


def packed_forward_backward(model, tokens: int, row_length: int, vocab: int) -> float:
    """Seconds for forward+backward over ``tokens`` tokens in full rows (no padding at all)."""
    rows = max(1, tokens // row_length)
    ids = torch.randint(0, vocab, (rows, row_length))
    start = time.perf_counter()
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


# The batching settings the update is timed under: (trainer.pass_overhead_tokens, trainer.packing).
BATCHINGS = {"rows, overhead 512": (512, False), "rows, overhead 32": (32, False),
             "packed": (32, True)}


def update_vs_limit(trainer: GRPOTrainer, trees, repeats: int) -> dict[str, float]:
    """The update on ``trees`` under each of `BATCHINGS` (alternating, best of ``repeats``
    each), against the packed-without-masks limit."""
    from selfcest.algo.advantages import compute_advantages
    from selfcest.train.batching import samples_from_trees

    samples = samples_from_trees(trees, compute_advantages(trees, trainer.config.algo.credit))
    tokens = sum(s.length for s in samples)
    longest = max(s.length for s in samples)
    vocab = trainer.policy.model.config.vocab_size
    seconds = {name: [] for name in [*BATCHINGS, "limit"]}
    results: dict[str, float] = {"samples": len(samples), "tokens": tokens}
    settings = trainer.config.trainer
    chosen = settings.pass_overhead_tokens, settings.packing
    for _ in range(repeats):
        for name, (settings.pass_overhead_tokens, settings.packing) in BATCHINGS.items():
            start = time.perf_counter()
            metrics = trainer.train_on_trees(trees)
            seconds[name].append(time.perf_counter() - start)
            results[f"padding_frac ({name})"] = metrics["train/padding_frac"]
            results[f"micro_batches ({name})"] = metrics["train/micro_batches"]
        seconds["limit"].append(packed_forward_backward(trainer.policy.model, tokens, longest,
                                                        vocab))
    settings.pass_overhead_tokens, settings.packing = chosen
    baseline = min(seconds["rows, overhead 512"])
    for name in BATCHINGS:
        results[f"update_s ({name})"] = min(seconds[name])
        results[f"ratio to rows, overhead 512 ({name})"] = min(seconds[name]) / baseline
    results["packed_limit_s"] = min(seconds["limit"])
    results["efficiency (limit / update, rows, overhead 32)"] = min(
        seconds["limit"]) / min(seconds["rows, overhead 32"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trees", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for size in args.sizes:
        trainer = trainer_for(size, f"/tmp/selfcest-bench-{size}")
        params = sum(p.numel() for p in trainer.policy.model.parameters())
        print(f"\n== {size}: {params / 1e6:.2f}M parameters, {torch.get_num_threads()} threads")
        for key, value in phase_split(trainer, args.steps).items():
            print(f"  {key:34s} {value:10.3f}")
        trees = demonstration_trees(trainer.policy, args.trees, trainer.backend.weight_version)
        for key, value in update_vs_limit(trainer, trees, args.repeats).items():
            print(f"  {key:34s} {value:10.3f}")
        trainer.close()


if __name__ == "__main__":
    main()
