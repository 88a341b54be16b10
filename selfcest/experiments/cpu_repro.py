"""The CPU reproduction: a small model learns to delegate; does it beat its monolithic twin?

The paper claims that a model trained end to end with clones (1) improves the
accuracy-cost Pareto frontier over monolithic baselines at matched inference budget and
(2) generalises out of distribution. This script tests both at laptop scale::

    python -m selfcest.experiments.cpu_repro            # make run; ~10 min on 2 cores
    python -m selfcest.experiments.cpu_repro --quick    # the test-sized variant (3-5 min)
    python -m selfcest.experiments.cpu_repro trainer.steps=40 rollout.budget.node_context=320

Settings live in ``configs/experiment/cpu_repro.yaml`` (``cpu_repro_quick.yaml``); extra
arguments override them. Steps, each timed, outputs under ``runs/<name>/``:

1. warm start: SFT of a fresh model on teacher demonstrations of both styles (shared);
2. arm A, clones: GRPO from the warm start; the root sees keys only and may spawn;
3. arm B, monolithic: GRPO from the same warm start on the same tasks with the lists
   printed in the prompt, spawning disabled, the same reward minus its clone terms, the
   same steps, prompts and trees per prompt;
4. each arm's held-out reward against its own SFT start, sampled as in training (the
   quantity RL optimises, on tasks it never saw); then the evaluation at matched
   total-token budgets, in distribution and out of distribution: clones (A), monolithic
   (B), self-consistency over k samples of B, and both styles of the warm start alone;
5. ``report.md``: tables with confidence intervals, Pareto plots, training curves, the
   frontier verdicts and example trees (text, and ``trace.html``).

Simplification: every node of both arms has the same per-node budgets (generation and
context); the total per-tree budget is what the evaluation matches.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from selfcest.budget import Budget
from selfcest.cli import CONFIG_DIR
from selfcest.eval.stats import bootstrap_mean
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends.base import SamplingParams
from selfcest.tasks.keyed_sum import inline_view
from selfcest.train.config import TrainConfig, held_out_splits, load_split
from selfcest.train.sft import held_out_tasks, warm_start
from selfcest.train.trainer import GRPOTrainer, build_policy, build_reward


@dataclass
class EvalSettings:
    """The evaluation sweep (not part of a training config)."""

    budgets: tuple[int, ...] = (128, 256, 512, 1024)  # total generated tokens per task
    tasks_per_split: int = 100  # held-out tasks per split (in distribution, OOD)
    sc_samples: int = 4  # k of self-consistency
    bootstrap: int = 1000  # resamples per confidence interval
    # Trees per held-out task when measuring each arm's reward at its training temperature.
    reward_samples: int = 4


FULL = EvalSettings()
QUICK = EvalSettings(budgets=(256, 1024), tasks_per_split=48, bootstrap=200)


@dataclass
class HeldOut:
    """One policy's held-out reward and accuracy under the training sampling and budget."""

    reward: list[float]  # per task, mean over its samples
    accuracy: list[float]  # per task, fraction of correct samples

    def difference(self, start: HeldOut, resamples: int = 2000, seed: int = 0) -> dict[str, float]:
        """Mean paired reward difference (self − start) over tasks, with a 95% bootstrap CI."""
        paired = bootstrap_mean([a - b for a, b in zip(self.reward, start.reward)], resamples, seed=seed)
        return {"reward": statistics.fmean(self.reward), "start": statistics.fmean(start.reward),
                "difference": paired.value, "low": paired.low, "high": paired.high,
                "accuracy": statistics.fmean(self.accuracy),
                "start_accuracy": statistics.fmean(start.accuracy)}


def compose(experiment: str, overrides: list[str]) -> TrainConfig:
    """The training config of ``experiment`` (configs/experiment/<experiment>.yaml)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from selfcest.cli import register_schemas, to_train_config

    register_schemas()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return to_train_config(hydra_compose("train", overrides=[f"experiment={experiment}", *overrides]))


def monolithic_view(config: TrainConfig):
    """How the monolithic arm sees a task: keyed_sum with its lists printed in the prompt
    (keys alone would leave it nothing to read); any other task as it is."""
    return inline_view if config.task.name == "keyed_sum" else None


def _view(config: TrainConfig, tasks: list) -> list:
    view = monolithic_view(config)
    return [view(task) for task in tasks] if view else list(tasks)


def monolithic_twin(config: TrainConfig) -> TrainConfig:
    """Arm B: spawning disabled, the task seen through `monolithic_view`, the clone cost
    terms off."""
    twin = copy.deepcopy(config)
    twin.name = f"{config.name}-monolithic"
    twin.rollout.budget.max_depth = 0
    params = twin.task.params
    if config.task.name == "keyed_sum":
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
    config.model.gguf_file = None  # the warm start is saved as a plain transformers folder
    config.trainer.output_dir = str(output)
    config.warm_start.tasks = {}  # the shared warm start already happened
    trainer = GRPOTrainer(config)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    trainer.policy.save_pretrained(output / "policy")
    return trainer.policy, history


def say(message: str) -> None:
    print(message, flush=True)


def run(config: TrainConfig, settings: EvalSettings, log=say, warm_started: Path | None = None) -> dict:
    """All five steps; returns the timings and where everything was written.

    ``warm_started``: a policy folder from an earlier run's warm start (``runs/<name>/sft``)
    to start both arms from instead of running step 1 again.
    """
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    if config.trainer.cpu_threads:
        torch.set_num_threads(config.trainer.cpu_threads)

    start = time.perf_counter()
    if warm_started is None:
        policy = build_policy(config)
        steps = config.warm_start.sft.steps

        def progress(step: int, metrics: dict) -> None:
            if step % max(1, steps // 10) == 0 or step == steps:
                log(f"warm start: SFT step {step}/{steps}, loss {metrics['sft/loss']:.3f}")

        history = warm_start(policy, config, held_out_tasks(config), log=progress)
        policy.save_pretrained(out / "sft")
        with open(out / "sft" / "sft.jsonl", "w") as sft_log:
            sft_log.writelines(json.dumps({"step": n, **m}) + "\n" for n, m in enumerate(history, 1))
    elif Path(warm_started).resolve() != (out / "sft").resolve():
        shutil.copytree(warm_started, out / "sft", dirs_exist_ok=True)
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
    sft = ClonePolicy.from_pretrained(out / "sft")
    tasks = evaluation_splits(config, settings)["in-distribution"]
    heldout = {
        "clones": held_out(config, clones, tasks, settings).difference(held_out(config, sft, tasks, settings)),
        "monolithic": held_out(twin, mono, _view(config, tasks), settings).difference(
            held_out(twin, sft, _view(config, tasks), settings)),
    }
    (out / "heldout.json").write_text(json.dumps(heldout, indent=2))
    timings["held-out reward"] = time.perf_counter() - mark
    log(f"held-out reward: {json.dumps(heldout)}")

    mark = time.perf_counter()
    results = evaluate_arms(config, settings, sft, clones, mono, out / "eval")
    timings["evaluation"] = time.perf_counter() - mark
    log(f"evaluation done in {timings['evaluation']:.0f}s")

    from selfcest.experiments.report import write_repro_report

    timings["total"] = time.perf_counter() - start
    report = write_repro_report(out, config, twin, settings, results, heldout, clones_history,
                                mono_history, timings)
    log(f"report: {report}")
    return {"timings": timings, "report": str(report), "results": results, "heldout": heldout}


def evaluation_splits(config: TrainConfig, settings: EvalSettings) -> dict[str, list]:
    """The first ``tasks_per_split`` tasks of the held-out splits (``task.eval_params``, and
    ``task.ood_params`` when given); neither the warm start nor RL ever sees them."""
    names = {"eval": "in-distribution", "ood": "out-of-distribution"}
    return {names[split]: load_split(config.task, split)[: settings.tasks_per_split]
            for split in held_out_splits(config.task)}


def held_out(config: TrainConfig, policy: ClonePolicy, tasks: list, settings: EvalSettings) -> HeldOut:
    """The policy's reward on held-out tasks as training samples it: same temperature, same
    budget, ``reward_samples`` trees per task (what RL optimises, measured on new tasks)."""
    from selfcest.rewards.base import score_trees

    rollout = config.rollout
    engine = policy.engine(rollout.budget, SamplingParams(rollout.temperature, rollout.top_p, rollout.top_k),
                           seed=config.trainer.seed + 1)
    trees = engine.rollout(tasks, samples_per_task=settings.reward_samples)
    score_trees(trees, tasks, build_reward(config))
    reward, accuracy = [], []
    for i in range(len(tasks)):
        group = [t for t in trees if t.task_index == i]
        reward.append(statistics.fmean(t.reward for t in group))
        accuracy.append(statistics.fmean(float(t.correct) for t in group))
    return HeldOut(reward, accuracy)


def evaluate_arms(config: TrainConfig, settings: EvalSettings, sft: ClonePolicy, clones: ClonePolicy,
                  mono: ClonePolicy, out: Path):
    """Every method at every budget on the held-out in-distribution and OOD tasks."""
    from selfcest.eval.evaluate import Method, evaluate

    splits = evaluation_splits(config, settings)
    base: Budget = config.rollout.budget
    view = monolithic_view(config)
    mono_budget = Budget(**{**vars(base), "max_depth": 0})
    methods = [
        Method("clones", "clones", budget=base, policy=clones),
        Method(f"sc@{settings.sc_samples}", "self_consistency", budget=mono_budget,
               samples=settings.sc_samples, task_view=view, policy=mono,
               sampling=SamplingParams(temperature=1.0)),
        Method("monolithic", "monolithic", budget=mono_budget, task_view=view, policy=mono),
        Method("clones (SFT start)", "clones", budget=base, policy=sft),
        Method("monolithic (SFT start)", "monolithic", budget=mono_budget, task_view=view,
               policy=sft),
    ]
    reward = build_reward(config)
    return evaluate(None, methods, splits, settings.budgets, reward, out,
                    sampling=SamplingParams(temperature=0), seed=config.trainer.seed,
                    bootstrap_samples=settings.bootstrap)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the CI-sized variant (<experiment>_quick.yaml if present, a small evaluation)")
    parser.add_argument("--experiment", default="cpu_repro",
                        help="another configs/experiment/ file to run through the same pipeline")
    parser.add_argument("--warm-started", type=Path, metavar="DIR",
                        help="reuse the warm start of an earlier run (its runs/<name>/sft folder)")
    parser.add_argument("--budgets", type=int, nargs="+", help="evaluation budgets (total tokens per task)")
    parser.add_argument("--tasks-per-split", type=int, help="held-out tasks per split")
    parser.add_argument("--sc-samples", type=int, help="k of self-consistency")
    parser.add_argument("--reward-samples", type=int, help="trees per task for the held-out reward")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.steps=40")
    args = parser.parse_args(argv)
    # --quick means the CI-sized config where one exists (<experiment>_quick.yaml), and the
    # QUICK evaluation either way.
    experiment = args.experiment
    if args.quick and (CONFIG_DIR / "experiment" / f"{experiment}_quick.yaml").exists():
        experiment = f"{experiment}_quick"
    config = compose(experiment, args.overrides)
    settings = QUICK if args.quick else FULL
    changes = {"budgets": tuple(args.budgets) if args.budgets else None, "tasks_per_split": args.tasks_per_split,
               "sc_samples": args.sc_samples, "reward_samples": args.reward_samples}
    settings = replace(settings, **{key: value for key, value in changes.items() if value is not None})
    run(config, settings, warm_started=args.warm_started)


if __name__ == "__main__":
    main()
