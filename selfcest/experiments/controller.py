"""The learned-controller experiment: does RL learn when and how widely to delegate?

The root sees every list of a keyed_sum task in its prompt, so it may solve directly or hand keys to
clones; past a size only delegation fits its context. One run is one cost setting and one seed::

    python -m selfcest.experiments.controller                               # 0.002/processed token
    python -m selfcest.experiments.controller experiment=controller_free    # no cost
    python -m selfcest.experiments.controller experiment=controller_latency # critical-path tokens
    python -m selfcest.experiments.controller experiment=controller_quick   # test-sized
    python -m selfcest.experiments.controller trainer.seed=1 \
        warm_start.policy=runs/controller/seed1/sft

`selfcest.experiments.controller_sweep` runs every setting and seed; `run` lists the steps.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from selfcest import machine
from selfcest.cli import register_schemas
from selfcest.configure import ConfigError, hydra_app
from selfcest.eval.decisions import (
    Decision,
    Mode,
    paired_gap,
    per_size,
    per_task,
    sample_trees,
    score_decisions,
)
from selfcest.experiments.common import (
    kept_checkpoint,
    kept_evaluation,
    load_policy,
    say,
    timed,
    train_arm,
    warm_start_folder,
)
from selfcest.experiments.controller_report import write_controller_report
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends.base import SamplingParams
from selfcest.task import Task
from selfcest.tasks import load_tasks
from selfcest.train.config import TrainConfig, held_out_splits, load_split
from selfcest.train.logging import read_metrics
from selfcest.train.setup import build_reward, held_out_tasks
from selfcest.tree import CloneTree

DEFAULT_EXPERIMENT = "controller"
POLICIES = ("warm start", "RL")
# "At least the best forced style": RL's reward minus it has a lower bound above this.
FORCED_MARGIN = -0.01
# A decision follows the reward where the free policy delegates at least this often when
# delegation is better (at most 1 - this when direct is).
DECISIVE_RATE = 0.8
# The skill a size needs (direct where the warm start's forced direct accuracy is >= SKILLED,
# delegation elsewhere) is kept when RL's accuracy in it is at least the warm start's less this.
SKILL_MARGIN = 0.05
SKILLED = 0.5
TREES_FILE = "decision_trees.jsonl"


def held_out_by_size(config: TrainConfig) -> list[Task]:
    """The first ``eval.tasks_per_split`` held-out tasks of each size (test split) and of the
    OOD split; neither the warm start nor RL sees them."""
    tasks: list[Task] = []
    for split in held_out_splits(config.task):
        by_size: dict[int, list[Task]] = {}
        for task in load_split(config.task, split):
            by_size.setdefault(len(task.context), []).append(task)
        tasks += [task for size in sorted(by_size) for task in config.eval.first(by_size[size])]
    return tasks


def training_sampling(config: TrainConfig) -> SamplingParams:
    rollout = config.rollout
    return SamplingParams(rollout.temperature, rollout.top_p, rollout.top_k)


def policy_trees(config: TrainConfig, policy: ClonePolicy, tasks: list[Task],
                 cache: Path | None = None) -> dict[Mode, list[CloneTree]]:
    """The policy's unscored trees in every mode, sampled as in training, ``eval.reward_samples``
    per task. With ``cache``, trees saved there by the same weights under the same tasks,
    budget, sampling and seed are read back instead of sampled, and new ones are saved."""
    seed, samples = config.trainer.seed + 1, config.eval.reward_samples
    key = _measurement_key(config, policy, tasks, seed)
    if cache is not None and cache.exists():
        lines = cache.read_text().splitlines()
        if lines and json.loads(lines[0]).get("key") == key:
            trees: dict[Mode, list[CloneTree]] = {mode: [] for mode in Mode}
            for line in lines[1:]:
                row = json.loads(line)
                trees[Mode(row["mode"])].append(CloneTree.from_dict(row["tree"]))
            return trees
    trees = {mode: sample_trees(policy, tasks, mode, config.rollout.budget,
                                training_sampling(config),
                                samples, seed=seed) for mode in Mode}
    if cache is not None:
        with open(cache, "w") as file:
            file.write(json.dumps({"key": key}) + "\n")
            file.writelines(json.dumps({"mode": mode.value, "tree": tree.to_dict()}) + "\n"
                            for mode, mode_trees in trees.items() for tree in mode_trees)
    return trees


def _measurement_key(config: TrainConfig, policy: ClonePolicy, tasks: list[Task], seed: int) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in policy.model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    what = {"weights": digest.hexdigest(), "tasks": [t.id for t in tasks],
            "budget": asdict(config.rollout.budget),
            "sampling": asdict(training_sampling(config)), "samples": config.eval.reward_samples,
            "seed": seed}
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=16).hexdigest()


def measure(config: TrainConfig, policy: ClonePolicy, tasks: list[Task], cache: Path
            | None = None) -> list[Decision]:
    """The policy in every mode on ``tasks``, sampled as in training, scored by this config's
    reward (trees from ``cache`` when it holds them)."""
    reward = build_reward(config)
    return [d for mode, trees in policy_trees(config, policy, tasks, cache).items()
            for d in score_decisions(trees, tasks, mode, reward, policy.protocol.spawn_open_id)]


def validation_tasks(config: TrainConfig) -> list[Task]:
    """``warm_start.validation_tasks`` tasks of each size from the warm-start source's test
    split: never demonstrated, and none of the experiment's held-out tasks."""
    source = config.warm_start.tasks
    params = {**source.params, "split": "test", "n_test": config.warm_start.validation_tasks}
    held_out = {t.prompt for t in held_out_tasks(config)}
    return [t for t in load_tasks(source.name, **params) if t.prompt not in held_out]


def validation_score(config: TrainConfig) -> Callable[[ClonePolicy], float] | None:
    """The score SFT checkpoints are kept by: the lowest greedy accuracy over the validation
    tasks of each forced style at each size the teacher demonstrates it (direct up to
    ``max_direct_keys``, delegation at every size), so a checkpoint scores well only when
    both styles work. None without validation tasks."""
    if not config.warm_start.validation_tasks:
        return None
    tasks = validation_tasks(config)
    limit = (config.warm_start.teacher_params.get("max_direct_keys")
             or max(len(t.context) for t in tasks))
    cells = {Mode.DIRECT: [t for t in tasks if len(t.context) <= limit], Mode.DELEGATE: tasks}
    reward, greedy = build_reward(config), SamplingParams(temperature=0.0)

    def score(policy: ClonePolicy) -> float:
        accuracies = []
        for mode, mode_tasks in cells.items():
            trees = sample_trees(policy, mode_tasks, mode, config.rollout.budget, greedy)
            rows = score_decisions(trees, mode_tasks, mode, reward, policy.protocol.spawn_open_id)
            for size in sorted({d.size for d in rows}):
                accuracies.append(statistics.fmean(d.correct for d in rows if d.size == size))
        return min(accuracies)

    return score


def boundary(rows: list[dict], sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` at which the free policy delegates at least half the time."""
    rates = {row["size"]: row["delegation_rate"]["value"] for row in rows if row["delegation_rate"]}
    return next((size for size in sorted(sizes) if rates.get(size, 0.0) >= 0.5), None)


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


def summarize(config: TrainConfig, decisions: dict[str, list[Decision]],
              history: list[dict]) -> dict:
    """Every figure and verdict of the report, as plain data (``results.json``)."""
    resamples = config.eval.bootstrap_samples
    trained = sorted(config.task.params.get("sizes") or [])
    rows = {name: [asdict(row) for row in per_size(policy_rows, resamples)] for name,
            policy_rows in decisions.items()}
    in_dist = {name: [d for d in policy_rows if d.size in trained] for name,
               policy_rows in decisions.items()}

    def reward(name: str, mode: Mode) -> dict[str, float]:
        return per_task(in_dist[name], "reward", mode.value)

    forced = {m.value: statistics.fmean(reward("RL", m).values())
              for m in (Mode.DIRECT, Mode.DELEGATE)}
    best_forced = max(forced, key=forced.get)
    against_start = paired_gap(reward("RL", Mode.FREE), reward("warm start", Mode.FREE), resamples)
    against_forced = paired_gap(reward("RL", Mode.FREE), reward("RL", Mode(best_forced)), resamples)
    trained_rows = {name: [r for r in policy_rows if r["size"] in trained] for name,
                    policy_rows in rows.items()}
    follows = [_follows(row) for row in trained_rows["RL"] if row["better"] != "tie"]
    return {
        "name": config.name, "seed": config.trainer.seed,
        "cost": config.task.reward_params.get("cost"),
        "credit": str(config.algo.credit.strategy), "trained_sizes": trained,
        "per_size": rows,
        "oracle": {name: {r["size"]: r["better"] for r in policy_rows} for name,
                   policy_rows in trained_rows.items()},
        "boundary": {name: boundary(policy_rows, trained) for name,
                     policy_rows in trained_rows.items()},
        "skills_kept": skills_kept(trained_rows),
        "decision_room": decision_room(trained_rows["warm start"]),
        "reward": {name: statistics.fmean(reward(name, Mode.FREE).values()) for name in decisions},
        "forced_reward": forced, "best_forced": best_forced,
        "rl_minus_start": asdict(against_start), "rl_minus_best_forced": asdict(against_forced),
        "beats_start": against_start.low > 0,
        "matches_best_forced": against_forced.low >= FORCED_MARGIN,
        "decisive_sizes": [size for size, ok in follows if ok],
        "indecisive_sizes": [s for s, ok in follows if not ok],
        "steps_to_90": steps_to_fraction(history),
        "final_train_reward": statistics.fmean(h["reward/mean"] for h in history[-4:]) if history
        else None,
        "training_rate": training_rates(history, trained),
    }


def _follows(row: dict) -> tuple[int, bool]:
    rate = row["delegation_rate"]["value"]
    return (row["size"], rate >= DECISIVE_RATE if row["better"] == "delegate" else rate <= 1
            - DECISIVE_RATE)


def decision_room(rows: list[dict]) -> float:
    """What choosing the better forced style at every size would add to the warm start's free
    reward (mean over sizes, which hold as many tasks each): the gain open to RL from the
    decision alone, its skills unchanged."""
    return statistics.fmean(max(r["reward"][Mode.DIRECT.value]["value"],
                                r["reward"][Mode.DELEGATE.value]["value"])
                            - r["reward"][Mode.FREE.value]["value"] for r in rows)


def skills_kept(rows: dict[str, list[dict]]) -> list[dict]:
    """The skill each size needs, before and after RL: direct where the warm start could
    solve directly (forced direct accuracy >= SKILLED), delegation elsewhere. Kept when RL's
    accuracy in it is at most SKILL_MARGIN below the warm start's. (A style RL stopped
    using where the other is better may decay; that is not counted.)"""
    kept = []
    for before, after in zip(rows["warm start"], rows["RL"]):
        direct = before["accuracy"][Mode.DIRECT.value]["value"] >= SKILLED
        mode = Mode.DIRECT.value if direct else Mode.DELEGATE.value
        start, end = before["accuracy"][mode]["value"], after["accuracy"][mode]["value"]
        kept.append({"size": before["size"], "style": mode, "warm start": start, "RL": end,
                     "kept": end >= start - SKILL_MARGIN})
    return kept


def training_rates(history: list[dict], sizes: list[int]) -> dict[int, list[float | None]]:
    """P(the root delegates) per size at every training step (None where a step drew no task
    of that size), from the trainer's ``decision/p_delegate/size_<k>`` metrics."""
    return {size: [h.get(f"decision/p_delegate/size_{size}") for h in history] for size in sizes}


def record(summary: dict) -> dict:
    """The run as one entry of ``docs/results/controller_sweep.json`` (see the README)."""
    cost = summary["cost"] or {}
    kind, weight = "none", 0.0
    if cost.get("per_critical_path_token"):
        kind, weight = "latency", cost["per_critical_path_token"]
    elif cost.get("per_processed_token"):
        kind, weight = "token", cost["per_processed_token"]
    sizes = summary["trained_sizes"]
    rows = {name: {r["size"]: r for r in summary["per_size"][name]} for name in POLICIES}

    def interval(gap: dict) -> list[float]:
        return [gap["low"], gap["value"], gap["high"]]

    return {
        "name": summary["name"], "cost": kind, "lambda": weight, "credit": summary["credit"],
        "seed": summary["seed"], "sizes": sizes,
        "p_delegate": {name: [rows[name][s]["delegation_rate"]["value"] for s in sizes]
                       for name in POLICIES},
        "oracle": [summary["oracle"]["warm start"][s] for s in sizes],
        "oracle_rl": [summary["oracle"]["RL"][s] for s in sizes],
        "forced": {name: {mode: [rows[name][s]["accuracy"][mode]["value"] for s in sizes]
                          for mode in (Mode.DIRECT.value, Mode.DELEGATE.value)}
                   for name in POLICIES},
        "clones_per_call": {name: [(rows[name][s]["branching"] or {}).get("value") for s in sizes]
                            for name in POLICIES},
        "boundary": summary["boundary"],
        "reward": summary["reward"],
        "decision_room": summary["decision_room"],
        "rl_minus_warm_start": interval(summary["rl_minus_start"]),
        "rl_minus_best_forced": interval(summary["rl_minus_best_forced"]),
        "decisive_sizes": summary["decisive_sizes"],
        "indecisive_sizes": summary["indecisive_sizes"],
        "skills_kept": all(s["kept"] for s in summary["skills_kept"]),
    }


def run(config: TrainConfig, log=say) -> dict:
    """All four steps; returns the summary.

    The warm start is uninformed (its teacher delegates by a coin flip wherever both styles fit, to
    2, 3 or 4 clones), so whatever preference the policy shows after RL, RL put it there.

    Steps, each timed, outputs under ``trainer.output_dir``:

    1. warm start: SFT on the teacher's demonstrations, validated (`validation_score`), or the
       folder ``warm_start.policy`` names;
    2. the forced-style table before RL: the warm start free, forced direct and forced delegate
       on the held-out tasks (`selfcest.eval.decisions`), at the training temperature and budget;
    3. RL: GRPO under the config's reward (its cost: ``task.reward_params.cost``);
    4. the same table for the RL policy; ``results.json`` and ``report.md``.

    A policy's trees do not depend on the cost, so the warm start's are sampled once and kept
    beside it (``sft/decision_trees.jsonl``): every setting of a seed re-scores them.
    """
    if config.trainer.keep_best and not config.warm_start.validation_tasks:
        raise ConfigError("trainer.keep_best: the controller keeps RL's best weights by the "
                          "validation tasks; set warm_start.validation_tasks > 0, or keep_best=''")
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.trainer.cpu_threads:
        torch.set_num_threads(config.trainer.cpu_threads)
    timings: dict[str, float] = {}
    tasks = held_out_by_size(config)
    with timed(timings, "warm start (SFT)", log):
        warm_start_folder(config, out / "sft", log, score=validation_score(config))
    with timed(timings, "forced styles before RL", log):
        before = measure(config, load_policy(config, out / "sft"), tasks,
                         cache=out / "sft" / TREES_FILE)
    with timed(timings, "RL", log):
        # Evaluated (and, under trainer.keep_best, kept) on the validation tasks: never on
        # the held-out ones this run reports.
        trained, history = train_arm(config, out / "sft", out / "rl",
                                     eval_tasks=validation_tasks(config))
    with timed(timings, "forced styles after RL", log):
        decisions = {"warm start": before, "RL": measure(config, trained, tasks)}
        with open(out / "decisions.jsonl", "w") as file:
            file.writelines(json.dumps({"policy": name, **asdict(d)}) + "\n"
                            for name, rows in decisions.items() for d in rows)

    return write_results(config, out, decisions, history, timings, machine.describe(), log)


def write_results(config: TrainConfig, out: Path, decisions: dict[str, list[Decision]],
                  history: list[dict], timings: dict[str, float], ran_on: dict | None,
                  log=say) -> dict:
    """``results.json`` (the summary and its `record`) and ``report.md``; returns the summary.
    ``timings`` and ``ran_on`` (`selfcest.machine.describe`) are the run's own."""
    summary = {**summarize(config, decisions, history), "timings": timings, "machine": ran_on,
               "warm_start": kept_checkpoint(out / "sft"), "rl_kept": kept_evaluation(out / "rl")}
    summary["record"] = record(summary)
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    report = write_controller_report(out, config, summary, history)
    log(f"report: {report}")
    return summary


def refresh(config: TrainConfig, log=say) -> dict:
    """Summarize a finished run again from what it saved (``decisions.jsonl``, the RL arm's
    ``metrics.jsonl``, the timings and machine of ``results.json``), with this version's
    summary and report: nothing is sampled or trained."""
    out = Path(config.trainer.output_dir)
    decisions: dict[str, list[Decision]] = {name: [] for name in POLICIES}
    for line in (out / "decisions.jsonl").read_text().splitlines():
        row = json.loads(line)
        decisions[row.pop("policy")].append(Decision(**row))
    saved = json.loads((out / "results.json").read_text())
    return write_results(config, out, decisions, read_metrics(out / "rl" / "metrics.jsonl"),
                         saved["timings"], saved.get("machine"), log)


def main() -> None:
    """The Hydra app: ``experiment=`` defaults to controller."""
    register_schemas()
    hydra_app("train", TrainConfig, run, program="python -m selfcest.experiments.controller",
              defaults=[f"experiment={DEFAULT_EXPERIMENT}"])


if __name__ == "__main__":
    main()
