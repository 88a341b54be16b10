"""Is a clone arm's held-out gain the doing of RL, or noise? Several RL seeds from one warm start.

One end-to-end run gives one held-out difference, RL policy minus warm start, whose interval
covers only the sampling of the held-out trees: it cannot tell a real gain from the spread
of RL itself (task order, sampled trees). This experiment trains the clone arm of an
experiment's config by GRPO from one saved warm start once per RL seed, and measures every
trained policy and the warm start on the same held-out tasks::

    selfcest-sft experiment=smollm_chain_sum trainer.output_dir=runs/smollm_seeds
    python -m selfcest.experiments.rl_seeds experiment=smollm_chain_sum \\
        warm_start.policy=runs/smollm_seeds/sft trainer.output_dir=runs/smollm_seeds eval.seeds=2

A Hydra app over the training config (``--help`` lists every key); `run` says which
settings it reads, what it writes and how a stopped run resumes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

from selfcest.cli import register_schemas
from selfcest.configure import ConfigError, hydra_app
from selfcest.eval.stats import bootstrap_mean
from selfcest.experiments.common import (
    check_resume,
    evaluation_splits,
    held_out,
    load_policy,
    say,
    train_arm,
)
from selfcest.task import Task
from selfcest.train.config import TrainConfig


def train_seed(base: TrainConfig, warm_started: Path, splits: dict[str, list[Task]], seed: int,
               folder: Path) -> tuple[dict, dict[str, list[float]]]:
    """Train ``base`` from ``warm_started`` under RL seed ``seed`` into ``folder`` and measure
    the policy's held-out reward on ``splits``; returns a row (seconds, training reward of the
    last 4 steps, held-out reward per split) and the per-task rewards of each split."""
    config = copy.deepcopy(base)
    config.trainer.seed = seed
    config.log.progress = False
    mark = time.perf_counter()
    policy, history = train_arm(config, warm_started, folder)
    row = {"seed": seed, "seconds": time.perf_counter() - mark,
           "train_reward_last4": statistics.fmean(h["reward/mean"] for h in history[-4:])}
    rewards = {name: held_out(config, policy, tasks, base.eval).reward for name,
               tasks in splits.items()}
    row.update({f"heldout/{name}": statistics.fmean(values) for name, values in rewards.items()})
    return row, rewards


def paired(after: list[float], before: list[float], resamples: int) -> list[float]:
    """Mean of the paired differences over tasks, with its 95% bootstrap interval."""
    difference = bootstrap_mean([a - b for a, b in zip(after, before)], resamples)
    return [difference.value, difference.low, difference.high]


def run(base: TrainConfig, log=say) -> dict:
    """Train and measure every seed from ``warm_start.policy``; returns the results written
    to ``trainer.output_dir``.

    The RL seeds are ``trainer.seed`` and the ``eval.seeds - 1`` after it; the held-out tasks
    are ``eval.tasks_per_split`` per split (``task.ood_params=null`` leaves out the
    out-of-distribution one), each sampled ``eval.reward_samples`` times at the training
    temperature, as `selfcest.experiments.common.held_out` does.

    Writes ``report.md`` and ``results.json`` under ``trainer.output_dir``: per seed and split
    the held-out reward and its paired difference to the warm start with a 95% bootstrap
    interval over tasks; per split the seed-averaged gain with its interval and the standard
    deviation of the seeds' mean rewards (how far RL alone moves the result).

    A stopped run resumes where it stopped: each finished seed leaves ``seed<k>/result.json`` and
    the warm start's measurement ``warm_start_heldout.json``, both with the config they were
    measured under; the same command (or one with more ``eval.seeds``) reuses every one whose
    config matches, and retrains the rest.

    Simplification: the warm start is shared, so the seeds vary the RL run, not the warm start;
    the warm start's held-out reward is sampled once (engine seed ``trainer.seed + 1``).
    """
    if base.warm_start.policy is None:
        raise ConfigError("warm_start.policy is required: the warm start every seed starts from "
                          "(selfcest-sft writes one to <trainer.output_dir>/sft)")
    check_resume(base)
    settings, warm_started = base.eval, Path(base.warm_start.policy)
    out = Path(base.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [base.trainer.seed + k for k in range(settings.seeds)]
    splits = evaluation_splits(base, settings)
    measured_under = fingerprint(base)
    start_file = out / "warm_start_heldout.json"
    start = reuse(start_file, measured_under, log)
    if start is None:
        sft = load_policy(base, warm_started)
        start = {name: held_out(base, sft, tasks, settings).reward for name,
                 tasks in splits.items()}
        del sft  # each seed loads its own copy of the warm start
        keep(start_file, measured_under, start)
    rows, per_task = [], {name: [] for name in splits}
    # results.json is rewritten after each seed: a stopped run keeps what it measured
    for seed in seeds:
        seed_file = out / f"seed{seed}" / "result.json"
        finished = reuse(seed_file, measured_under, log)
        if finished is None:
            row, rewards = train_seed(base, warm_started, splits, seed, out / f"seed{seed}")
            row["gain"] = {name: paired(rewards[name], start[name], settings.bootstrap_samples)
                           for name in splits}
            keep(seed_file, measured_under, {"row": row, "rewards": rewards})
        else:
            row, rewards = finished["row"], finished["rewards"]
        log(json.dumps(row))
        rows.append(row)
        for name in splits:
            per_task[name].append(rewards[name])
        results = summarise(base, seeds, rows, per_task, start)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "report.md").write_text(report(results))
    log(f"report: {out / 'report.md'}")
    return results


def fingerprint(base: TrainConfig) -> dict:
    """What a measurement depends on besides its RL seed: the whole config except the output
    folder, the number of seeds and logging."""
    config = json.loads(json.dumps(dataclasses.asdict(base), default=str))
    del config["trainer"]["output_dir"], config["eval"]["seeds"], config["log"]
    return config


def keep(path: Path, measured_under: dict, measured: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # renamed when whole: a stop mid-write leaves no half file
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"config": measured_under, "measured": measured}))
    partial.replace(path)


def reuse(path: Path, measured_under: dict, log) -> dict | None:
    """What ``path`` kept, if it was measured under the same config; None otherwise."""
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    if kept["config"] != measured_under:
        log(f"{path} was measured under another config: measuring again")
        return None
    log(f"reusing {path}")
    return kept["measured"]


def summarise(base: TrainConfig, seeds: list[int], rows: list[dict],
              per_task: dict[str, list[list[float]]],
              start: dict[str, list[float]]) -> dict:
    """The runs so far, and per split the gain of the seeds' mean policy reward over the warm
    start and the spread of the seeds' means."""
    settings = base.eval
    summary = {name: {"start": statistics.fmean(start[name]),
                      "gain_of_seed_mean": paired([statistics.fmean(v)
                                                   for v in zip(*seeds_rewards)], start[name],
                                                  settings.bootstrap_samples),
                      "seed_std": spread([statistics.fmean(v) for v in seeds_rewards])}
               for name, seeds_rewards in per_task.items()}
    return {"experiment": base.name, "seeds": seeds, "tasks_per_split": settings.tasks_per_split,
            "reward_samples": settings.reward_samples, "runs": rows, "summary": summary}


def spread(values: list[float]) -> float:
    """Sample standard deviation; 0 for a single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def interval(values: list[float]) -> str:
    return f"{values[0]:+.3f} [{values[1]:+.3f}, {values[2]:+.3f}]"


def report(results: dict) -> str:
    """The results as markdown: a row per seed and split, then the seed-averaged summary."""
    lines = [f"# RL seeds from one warm start: {results['experiment']}", "",
             f"Held-out: {results['tasks_per_split']} tasks per split, {results['reward_samples']} "
             "trees each at the training temperature; 95% bootstrap intervals over tasks.", "",
             "| seed | split | held-out reward | gain over warm start | training reward, last 4 "
             "steps | seconds |",
             "|---|---|---|---|---|---|"]
    for row in results["runs"]:
        for name, gain in row["gain"].items():
            lines.append(f"| {row['seed']} | {name} | {row[f'heldout/{name}']:.3f} | "
                         f"{interval(gain)} | {row['train_reward_last4']:.3f} | "
                         f"{row['seconds']:.0f} |")
    lines += ["", "| split | warm start | gain of the seeds' mean | std of the seeds' means |",
              "|---|---|---|---|"]
    for name, row in results["summary"].items():
        lines.append(f"| {name} | {row['start']:.3f} | {interval(row['gain_of_seed_mean'])} | "
                     f"{row['seed_std']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """The Hydra app: ``experiment=`` defaults to cpu_repro, ``trainer.output_dir`` to
    runs/rl_seeds."""
    register_schemas()
    hydra_app("train", TrainConfig, run, program="python -m selfcest.experiments.rl_seeds",
              defaults=["experiment=cpu_repro", "trainer.output_dir=runs/rl_seeds"])


if __name__ == "__main__":
    main()
