"""The CPU reproduction: a small model learns to delegate; does it beat its monolithic twin?

The paper claims that a model trained end to end with clones (1) improves the
accuracy-cost Pareto frontier over monolithic baselines at matched inference budget and
(2) generalises out of distribution. This script tests both at laptop scale::

    python -m selfcest.experiments.cpu_repro            # make run; ~15 min on 2 cores
    python -m selfcest.experiments.cpu_repro --quick    # the CI-sized variant
    python -m selfcest.experiments.cpu_repro trainer.steps=40 rollout.budget.node_context=320

Settings live in ``configs/experiment/cpu_repro.yaml`` (``cpu_repro_quick.yaml``); extra
arguments override them. Steps, each timed, outputs under ``runs/<name>/``:

1. warm start: SFT of a fresh model on teacher demonstrations of both styles (shared);
2. arm A, clones: GRPO from the warm start; the root sees keys only and may spawn;
3. arm B, monolithic: GRPO from the same warm start on the same tasks with the lists
   printed in the prompt, spawning disabled, the same reward minus its clone terms, the
   same steps, prompts and trees per prompt;
4. evaluation at matched total-token budgets, in distribution and out of distribution:
   clones (A), monolithic (B), self-consistency over k samples of B, and both styles of
   the warm start alone (the SFT starting points);
5. ``report.md``: tables with confidence intervals, Pareto plots, training curves, the
   frontier verdicts and example trees (text, and ``trace.html``).

Simplification: every node of both arms has the same per-node budgets (generation and
context); the total per-tree budget is what the evaluation matches.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from selfcest.budget import Budget
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends.base import SamplingParams
from selfcest.tasks import load_tasks
from selfcest.tasks.keyed_sum import inline_view
from selfcest.train.config import TrainConfig
from selfcest.train.sft import warm_start
from selfcest.train.trainer import GRPOTrainer, build_policy, build_reward


@dataclass
class EvalSettings:
    """The evaluation sweep (not part of a training config)."""

    budgets: tuple[int, ...] = (96, 160, 256, 512)  # total generated tokens per task
    tasks_per_split: int = 100  # held-out tasks per split (in distribution, OOD)
    sc_samples: int = 4  # k of self-consistency
    bootstrap: int = 1000  # resamples per confidence interval


FULL = EvalSettings()
QUICK = EvalSettings(budgets=(160, 512), tasks_per_split=32, bootstrap=200)


def compose(experiment: str, overrides: list[str]) -> TrainConfig:
    """The training config of ``experiment`` (configs/experiment/<experiment>.yaml)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from selfcest.cli import CONFIG_DIR, register_schemas, to_train_config

    register_schemas()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return to_train_config(hydra_compose("train", overrides=[f"experiment={experiment}", *overrides]))


def monolithic_twin(config: TrainConfig) -> TrainConfig:
    """Arm B: spawning disabled, the lists printed in the prompt, the clone cost terms off."""
    twin = copy.deepcopy(config)
    twin.name = f"{config.name}-monolithic"
    twin.rollout.budget.max_depth = 0
    params = twin.task.params
    for split in ("train", "ood"):
        params[split] = {**dict(params.get(split) or {}), "inline": True}
    cost = dict(twin.task.reward_params.get("cost") or {})
    if cost:
        cost.update(clone_length=None, spawn_calls=None, per_clone=0.0)
        twin.task.reward_params = {**twin.task.reward_params, "cost": cost}
    return twin


def train_arm(config: TrainConfig, start: Path, output: Path) -> tuple[ClonePolicy, list[dict]]:
    """GRPO from the warm-start policy saved at ``start``; the trained policy is saved."""
    config = copy.deepcopy(config)
    config.model.name = str(start)
    config.trainer.output_dir = str(output)
    config.warm_start.tasks = {}  # the shared warm start already happened
    trainer = GRPOTrainer(config)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    trainer.policy.save_pretrained(output / "policy")
    return trainer.policy, history


def run(config: TrainConfig, settings: EvalSettings, log=print) -> dict:
    """All five steps; returns the timings and where everything was written."""
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    if config.trainer.cpu_threads:
        torch.set_num_threads(config.trainer.cpu_threads)

    start = time.perf_counter()
    policy = build_policy(config)
    sft_log = open(out / "sft.jsonl", "w")
    warm_start(policy, config.warm_start,
               log=lambda step, m: sft_log.write(json.dumps({"step": step, **m}) + "\n"))
    sft_log.close()
    policy.save_pretrained(out / "sft")
    timings["warm start (SFT)"] = time.perf_counter() - start
    log(f"warm start done in {timings['warm start (SFT)']:.0f}s")

    mark = time.perf_counter()
    clones, clones_history = train_arm(config, out / "sft", out / "clones")
    timings["GRPO, clones"] = time.perf_counter() - mark
    log(f"arm A (clones) done in {timings['GRPO, clones']:.0f}s")

    mark = time.perf_counter()
    twin = monolithic_twin(config)
    mono, mono_history = train_arm(twin, out / "sft", out / "monolithic")
    timings["GRPO, monolithic"] = time.perf_counter() - mark
    log(f"arm B (monolithic) done in {timings['GRPO, monolithic']:.0f}s")

    mark = time.perf_counter()
    results = evaluate_arms(config, settings, ClonePolicy.from_pretrained(out / "sft"), clones, mono,
                            out / "eval")
    timings["evaluation"] = time.perf_counter() - mark
    log(f"evaluation done in {timings['evaluation']:.0f}s")

    from selfcest.experiments.report import write_repro_report

    timings["total"] = time.perf_counter() - start
    report = write_repro_report(out, config, twin, settings, results, clones_history, mono_history, timings)
    log(f"report: {report}")
    return {"timings": timings, "report": str(report), "results": results}


def evaluate_arms(config: TrainConfig, settings: EvalSettings, sft: ClonePolicy, clones: ClonePolicy,
                  mono: ClonePolicy, out: Path):
    """Every method at every budget on the held-out in-distribution and OOD tasks."""
    from selfcest.eval.evaluate import Method, evaluate

    params = dict(config.task.params)
    n = settings.tasks_per_split
    splits = {
        "in-distribution": load_tasks(config.task.name, **{**params, "split": "test"})[:n],
        "out-of-distribution": load_tasks(config.task.name, **{**params, "split": "ood"})[:n],
    }
    base: Budget = config.rollout.budget
    mono_budget = Budget(**{**vars(base), "max_depth": 0})
    methods = [
        Method("clones", "clones", budget=base, policy=clones),
        Method(f"sc@{settings.sc_samples}", "self_consistency", budget=mono_budget,
               samples=settings.sc_samples, task_view=inline_view, policy=mono,
               sampling=SamplingParams(temperature=1.0)),
        Method("monolithic", "monolithic", budget=mono_budget, task_view=inline_view, policy=mono),
        Method("clones (SFT start)", "clones", budget=base, policy=sft),
        Method("monolithic (SFT start)", "monolithic", budget=mono_budget, task_view=inline_view,
               policy=sft),
    ]
    reward = build_reward(config)
    return evaluate(None, methods, splits, settings.budgets, reward, out,
                    sampling=SamplingParams(temperature=0), seed=config.trainer.seed,
                    bootstrap_samples=settings.bootstrap)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized variant (cpu_repro_quick)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.steps=40")
    args = parser.parse_args(argv)
    config = compose("cpu_repro_quick" if args.quick else "cpu_repro", args.overrides)
    run(config, QUICK if args.quick else FULL)


if __name__ == "__main__":
    main()
