"""Which loss aggregation should clone runs use? Measured on the CPU reproduction's clone arm.

A step's loss averages token losses over the nodes of many trees. Under ``token_mean`` (every
token weighs the same) and ``seq_mean_token_mean`` (every node weighs the same) a tree with
8 clones carries 9 times the gradient of a tree without any; under ``tree_mean`` every tree
weighs the same (`selfcest.algo.losses.aggregation_weights`). This experiment trains the
clone arm of the CPU reproduction (``configs/experiment/cpu_repro.yaml``) from one shared
warm start under each aggregation and several RL seeds, and compares the held-out reward at
the training temperature (what RL optimises, on tasks it never saw)::

    selfcest-sft experiment=cpu_repro trainer.output_dir=runs/aggregation
    python -m selfcest.experiments.aggregation warm_start.policy=runs/aggregation/sft eval.seeds=3

A Hydra app over the ``cpu_repro`` experiment (``--help`` lists every key); `run` says
which settings it reads and what it writes.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

from selfcest.algo.losses import AGGREGATIONS, aggregation_weights
from selfcest.cli import register_schemas
from selfcest.configure import ConfigError, hydra_app
from selfcest.eval.stats import bootstrap_mean
from selfcest.experiments.common import evaluation_splits, held_out, load_policy, say
from selfcest.experiments.rl_seeds import train_seed
from selfcest.rollout.backends.base import SamplingParams
from selfcest.train.config import TrainConfig
from selfcest.tree import CloneTree


def largest_trees_share(trees: list[CloneTree], mode: str) -> float:
    """Share of a step's gradient weight (sum over its tokens of the aggregation weight) that
    goes to the quarter of ``trees`` with the most nodes; 0.25 when every tree weighs the same."""
    lengths, tree_ids = [], []
    for i, tree in enumerate(trees):
        for node in tree.nodes.values():
            lengths.append(node.generated_tokens)
            tree_ids.append(i)
    weights = aggregation_weights(lengths, tree_ids, mode)
    mass = [0.0] * len(trees)
    for w, n, i in zip(weights, lengths, tree_ids):
        mass[i] += w * n
    largest = sorted(range(len(trees)),
                     key=lambda i: len(trees[i].nodes))[-max(1, len(trees) // 4):]
    return sum(mass[i] for i in largest) / sum(mass)


def run(base: TrainConfig, log=say) -> dict:
    """Train and measure every (aggregation, seed) from the warm start ``warm_start.policy``;
    returns the results written to ``trainer.output_dir``.

    The RL seeds are ``trainer.seed`` and the ``eval.seeds - 1`` after it, the held-out sets
    ``eval.tasks_per_split`` tasks per split, ``eval.reward_samples`` trees per task.

    Writes ``runs/aggregation/report.md`` and ``results.json``: per aggregation and split, the
    held-out reward (mean over seeds of the per-task mean over samples), its paired difference to
    the warm start and to ``token_mean`` with 95% bootstrap intervals over tasks, and the share of
    the first step's gradient weight that went to trees with clones.

    Simplification: the warm start is shared, so the comparison is of RL alone; the seeds vary the
    RL run (task order, sampling), not the warm start.
    """
    if base.warm_start.policy is None:
        raise ConfigError("warm_start.policy is required: the warm start every run starts from "
                          "(selfcest-sft experiment=cpu_repro writes one to <output_dir>/sft)")
    settings, warm_started = base.eval, Path(base.warm_start.policy)
    seeds = [base.trainer.seed + k for k in range(settings.seeds)]
    out = Path(base.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = evaluation_splits(base, settings)
    sft = load_policy(base, warm_started)
    start_reward = {name: held_out(base, sft, tasks, settings).reward for name,
                    tasks in splits.items()}
    rollout = base.rollout
    engine = sft.engine(rollout.budget, SamplingParams(rollout.temperature), seed=base.trainer.seed)
    first_step = engine.rollout(splits["in-distribution"][: base.trainer.prompts_per_step],
                                base.trainer.trees_per_prompt)
    shares = {mode: largest_trees_share(first_step, mode) for mode in AGGREGATIONS}
    per_task: dict[str, dict[str, list[list[float]]]] = {}
    runs = []
    for mode in AGGREGATIONS:
        config = copy.deepcopy(base)
        config.algo.loss.aggregation = mode
        per_task[mode] = {name: [] for name in splits}
        for seed in seeds:
            row, rewards = train_seed(config, warm_started, splits, seed,
                                      out / f"{mode}_seed{seed}")
            for name in splits:
                per_task[mode][name].append(rewards[name])
            runs.append({"aggregation": mode, **row})
            log(json.dumps(runs[-1]))
    summary = summarise(per_task, start_reward, settings.bootstrap_samples)
    results = {"seeds": seeds, "runs": runs, "summary": summary, "largest_trees_share": shares,
               "start": {name: statistics.fmean(values) for name, values in start_reward.items()}}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(report(results))
    return results


def summarise(per_task, start_reward, resamples: int) -> list[dict]:
    """Per aggregation and split: the seed-averaged held-out reward and its paired
    differences (over tasks) to the warm start and to token_mean."""
    rows = []
    for mode, by_split in per_task.items():
        for name, seeds in by_split.items():
            mean_of_seeds = [statistics.fmean(values) for values in zip(*seeds)]
            baseline = [statistics.fmean(v) for v in zip(*per_task["token_mean"][name])]
            gain = bootstrap_mean([a - b for a, b in zip(mean_of_seeds, start_reward[name])],
                                  resamples)
            versus = bootstrap_mean([a - b for a, b in zip(mean_of_seeds, baseline)], resamples)
            seed_means = [statistics.fmean(values) for values in seeds]
            rows.append({"aggregation": mode, "split": name,
                         "reward": statistics.fmean(mean_of_seeds),
                         "seed_std": statistics.pstdev(seed_means),
                         "gain": [gain.value, gain.low, gain.high],
                         "vs_token_mean": [versus.value, versus.low, versus.high]})
    return rows


def report(results: dict) -> str:
    lines = ["# Loss aggregation on the CPU reproduction's clone arm", "",
             f"RL seeds: {results['seeds']}; warm start held-out reward: "
             + ", ".join(f"{k} {v:.3f}" for k, v in results["start"].items()), "",
             "Share of one step's gradient weight on the quarter of its trees with the most "
             "nodes (warm start, 8 prompts x 8 trees; 0.25 = every tree weighs the same): "
             + ", ".join(f"{k} {v:.2f}" for k, v in results["largest_trees_share"].items()), "",
             "| aggregation | split | held-out reward | seed std | gain over warm start | vs "
             "token_mean |",
             "|---|---|---|---|---|---|"]
    for row in results["summary"]:
        gain, versus = row["gain"], row["vs_token_mean"]
        lines.append(f"| {row['aggregation']} | {row['split']} | {row['reward']:.3f} | "
                     f"{row['seed_std']:.3f} | {gain[0]:+.3f} [{gain[1]:+.3f}, {gain[2]:+.3f}] | "
                     f"{versus[0]:+.3f} [{versus[1]:+.3f}, {versus[2]:+.3f}] |")
    lines += ["", "| aggregation | seed | held-out (in distribution) | held-out (OOD) | "
              "training reward, last 4 steps | seconds |", "|---|---|---|---|---|---|"]
    for row in results["runs"]:
        lines.append(f"| {row['aggregation']} | {row['seed']} | "
                     f"{row.get('heldout/in-distribution', float('nan')):.3f} | "
                     f"{row.get('heldout/out-of-distribution', float('nan')):.3f} | "
                     f"{row['train_reward_last4']:.3f} | {row['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """The Hydra app: ``experiment=`` defaults to cpu_repro, ``trainer.output_dir`` to
    runs/aggregation."""
    register_schemas()
    hydra_app("train", TrainConfig, run, program="python -m selfcest.experiments.aggregation",
              defaults=["experiment=cpu_repro", "trainer.output_dir=runs/aggregation"])


if __name__ == "__main__":
    main()
