"""The learned-controller experiment: does RL learn when and how widely to delegate?

The root sees every list of a keyed_sum task in its prompt, so it may solve directly or hand
keys to clones; at the larger sizes only delegation fits its context. The warm start is
uninformed (its teacher delegates with probability 0.5 wherever both styles fit, with 2, 3
or 4 clones drawn uniformly), so whatever preference the policy shows after RL, RL put it
there. One run is one cost setting and one seed::

    python -m selfcest.experiments.controller                                # λ = 0.002 per generated token
    python -m selfcest.experiments.controller experiment=controller_free     # no cost
    python -m selfcest.experiments.controller experiment=controller_latency  # critical-path tokens
    python -m selfcest.experiments.controller experiment=controller_quick    # test-sized
    python -m selfcest.experiments.controller trainer.seed=1 warm_start.policy=runs/controller/seed1/sft

`selfcest.experiments.controller_sweep` runs every setting and seed and tabulates them.
Steps, each timed, outputs under ``trainer.output_dir`` (``runs/<name>/seed<k>``):

1. warm start: SFT on the uninformed teacher's demonstrations (or ``warm_start.policy``);
2. RL: GRPO under the config's reward (its cost type and λ: ``task.reward_params.cost``);
3. decisions: the warm start and the RL policy, each free, forced direct and forced delegate
   (`selfcest.eval.decisions`), ``eval.reward_samples`` trees per held-out task at the
   training temperature and budget, ``eval.tasks_per_split`` tasks of every size and of the
   OOD size;
4. ``results.json`` and ``report.md``: per-size delegation rate, branching and every mode's
   reward before and after RL, the oracle style per size, and the verdicts.

Simplification: the forced styles are measured with each policy's own weights; the oracle
style of a size is the forced style whose reward is higher by an interval that excludes 0
(otherwise a tie), judged for the RL policy on its own weights.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from selfcest.cli import register_schemas
from selfcest.configure import hydra_app
from selfcest.eval.decisions import Decision, Mode, per_size, per_task, paired_gap, sample_decisions
from selfcest.experiments.controller_report import write_controller_report
from selfcest.experiments.cpu_repro import load_policy, say, timed, train_arm, warm_start_folder
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends.base import SamplingParams
from selfcest.task import Task
from selfcest.train.config import TrainConfig, held_out_splits, load_split
from selfcest.train.setup import build_reward

DEFAULT_EXPERIMENT = "controller"
POLICIES = ("warm start", "RL")
# "At least the best forced style": RL's reward minus it has a lower bound above this.
FORCED_MARGIN = -0.01
# A decision follows the reward where the free policy delegates at least this often when
# delegation is better (at most 1 - this when direct is).
DECISIVE_RATE = 0.8


def held_out_by_size(config: TrainConfig) -> list[Task]:
    """The first ``eval.tasks_per_split`` held-out tasks of each size (test split) and of the
    OOD split; neither the warm start nor RL sees them."""
    n = config.eval.tasks_per_split
    tasks: list[Task] = []
    for split in held_out_splits(config.task):
        by_size: dict[int, list[Task]] = {}
        for task in load_split(config.task, split):
            by_size.setdefault(len(task.context), []).append(task)
        tasks += [task for size in sorted(by_size) for task in by_size[size][:n]]
    return tasks


def measure(config: TrainConfig, policy: ClonePolicy, tasks: list[Task]) -> list[Decision]:
    """The policy in every mode on ``tasks``, sampled as in training."""
    rollout = config.rollout
    sampling = SamplingParams(rollout.temperature, rollout.top_p, rollout.top_k)
    reward = build_reward(config)
    return [d for mode in Mode
            for d in sample_decisions(policy, tasks, mode, rollout.budget, sampling, reward,
                                      config.eval.reward_samples, seed=config.trainer.seed + 1)]


def steps_to_fraction(history: list[dict], fraction: float = 0.9, window: int = 4) -> int | None:
    """First training step whose running mean reward (over ``window`` steps) has covered
    ``fraction`` of the way from the first window's mean to the last window's; None when
    the run did not improve."""
    rewards = [h["reward/mean"] for h in history]
    if len(rewards) < 2 * window:
        return None
    smooth = [statistics.fmean(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
    start, end = smooth[window - 1], smooth[-1]
    if end <= start:
        return None
    target = start + fraction * (end - start)
    return next(i + 1 for i, value in enumerate(smooth) if i >= window - 1 and value >= target)


def summarize(config: TrainConfig, decisions: dict[str, list[Decision]], history: list[dict]) -> dict:
    """Every figure and verdict of the report, as plain data (``results.json``)."""
    resamples = config.eval.bootstrap_samples
    trained = set(config.task.params.get("sizes") or [])
    rows = {name: per_size(rows, resamples) for name, rows in decisions.items()}
    in_dist = {name: [d for d in rows_ if d.size in trained] for name, rows_ in decisions.items()}

    def reward(name: str, mode: Mode) -> dict[str, float]:
        return per_task(in_dist[name], "reward", mode.value)

    forced = {m.value: statistics.fmean(reward("RL", m).values()) for m in (Mode.DIRECT, Mode.DELEGATE)}
    best_forced = max(forced, key=forced.get)
    against_start = paired_gap(reward("RL", Mode.FREE), reward("warm start", Mode.FREE), resamples)
    against_forced = paired_gap(reward("RL", Mode.FREE), reward("RL", Mode(best_forced)), resamples)
    follows = [_follows(row) for row in rows["RL"] if row.size in trained and row.better != "tie"]
    return {
        "name": config.name, "seed": config.trainer.seed, "cost": config.task.reward_params.get("cost"),
        "credit": str(config.algo.credit.strategy), "trained_sizes": sorted(trained),
        "per_size": {name: [asdict(row) for row in rows_] for name, rows_ in rows.items()},
        "reward": {name: statistics.fmean(reward(name, Mode.FREE).values()) for name in decisions},
        "forced_reward": forced, "best_forced": best_forced,
        "rl_minus_start": asdict(against_start), "rl_minus_best_forced": asdict(against_forced),
        "beats_start": against_start.low > 0, "matches_best_forced": against_forced.low >= FORCED_MARGIN,
        "decisive_sizes": [size for size, ok in follows if ok], "indecisive_sizes": [s for s, ok in follows if not ok],
        "steps_to_90": steps_to_fraction(history),
        "final_train_reward": statistics.fmean(h["reward/mean"] for h in history[-4:]) if history else None,
    }


def _follows(row) -> tuple[int, bool]:
    rate = row.delegation_rate.value
    return row.size, rate >= DECISIVE_RATE if row.better == "delegate" else rate <= 1 - DECISIVE_RATE


def run(config: TrainConfig, log=say) -> dict:
    """All four steps; returns the summary."""
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.trainer.cpu_threads:
        torch.set_num_threads(config.trainer.cpu_threads)
    timings: dict[str, float] = {}
    with timed(timings, "warm start (SFT)", log):
        warm_start_folder(config, out / "sft", log)
    with timed(timings, "RL", log):
        trained, history = train_arm(config, out / "sft", out / "rl")
    with timed(timings, "decisions", log):
        tasks = held_out_by_size(config)
        policies = {"warm start": load_policy(config, out / "sft"), "RL": trained}
        decisions = {name: measure(config, policy, tasks) for name, policy in policies.items()}
        with open(out / "decisions.jsonl", "w") as file:
            file.writelines(json.dumps({"policy": name, **asdict(d)}) + "\n"
                            for name, rows in decisions.items() for d in rows)

    summary = {**summarize(config, decisions, history), "timings": timings}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    report = write_controller_report(out, config, summary, history)
    log(f"report: {report}")
    return summary


def main() -> None:
    """The Hydra app: ``experiment=`` defaults to controller."""
    register_schemas()
    hydra_app("train", TrainConfig, run, program="python -m selfcest.experiments.controller",
              defaults=[f"experiment={DEFAULT_EXPERIMENT}"])


if __name__ == "__main__":
    main()
