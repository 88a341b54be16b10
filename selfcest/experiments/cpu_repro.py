"""The CPU reproduction: a small model learns to delegate; does it beat its monolithic twin?

The paper claims that a model trained end to end with clones (1) improves the accuracy-cost
Pareto frontier over monolithic baselines at matched inference budget and (2) generalises out
of distribution. This script tests both at laptop scale::

    python -m selfcest.experiments.cpu_repro                            # make run; ~10 min, 2 cores
    python -m selfcest.experiments.cpu_repro experiment=cpu_repro_quick   # the test-sized variant
    python -m selfcest.experiments.cpu_repro trainer.steps=40 rollout.budget.node_context=320
    python -m selfcest.experiments.cpu_repro warm_start.policy=runs/cpu_repro/sft  # reuse a start
    python -m selfcest.experiments.cpu_repro trainer.resume=true   # resume a stopped run

A Hydra app like ``selfcest-train`` (``--help`` lists every key): the experiment is
``configs/experiment/cpu_repro.yaml`` unless ``experiment=`` names another, its ``eval`` section
sets the evaluation, and extra arguments override anything. `run` lists its five steps.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from selfcest.budget import Budget
from selfcest.cli import register_schemas
from selfcest.configure import hydra_app
from selfcest.eval.delegation import delegation_stats
from selfcest.eval.evaluate import Method, evaluate
from selfcest.experiments.common import (
    check_resume,
    evaluation_splits,
    held_out,
    load_policy,
    say,
    timed,
    train_arm,
    training_engine,
    warm_start_folder,
)
from selfcest.experiments.report import write_repro_report
from selfcest.policy import ClonePolicy
from selfcest.rewards.base import score_trees
from selfcest.rollout.backends.base import SamplingParams
from selfcest.task import Task
from selfcest.tasks import TASKS, TEACHERS
from selfcest.train.config import EvaluationConfig, TrainConfig, load_split, validate
from selfcest.train.setup import build_reward

DEFAULT_EXPERIMENT = "cpu_repro"


def monolithic_view(config: TrainConfig):
    """How the monolithic arm sees a task: the task source's monolithic view (keyed_sum: its
    lists printed in the prompt, where keys alone would leave it nothing to read), or the
    task as it is."""
    return TASKS[config.task.name].monolithic_view


def _view(config: TrainConfig, tasks: list[Task]) -> list[Task]:
    view = monolithic_view(config)
    return [view(task) for task in tasks] if view else list(tasks)


def monolithic_twin(config: TrainConfig) -> TrainConfig:
    """Arm B's config: spawning disabled, the clone cost terms off and broadcast credit (its
    trees are roots alone, to which every strategy gives the root's advantage; a strategy that
    needs clones would refuse the config). Its tasks are the same, seen through
    `monolithic_view`."""
    twin = copy.deepcopy(config)
    twin.name = f"{config.name}-monolithic"
    twin.rollout.budget.max_depth = 0
    twin.algo.credit.strategy = "broadcast"
    cost = dict(twin.task.reward_params.get("cost") or {})
    if cost:
        cost.update(clone_length=None, spawn_calls=None, per_clone=0.0)
        twin.task.reward_params = {**twin.task.reward_params, "cost": cost}
    return twin


def validation_score(config: TrainConfig) -> Callable[[ClonePolicy], float] | None:
    """The score SFT checkpoints are kept by: the lower of the two arms' greedy accuracy on
    the first ``warm_start.validation_tasks`` tasks of the training split (never demonstrated:
    the demonstrations come from another seed), the clone arm under its budget and the
    monolithic twin on its view with spawning off; so a checkpoint scores well only when both
    arms' styles work. None without validation tasks."""
    n = config.warm_start.validation_tasks
    if not n:
        return None
    tasks = load_split(config.task, "train")[:n]
    twin, greedy = monolithic_twin(config), SamplingParams(temperature=0.0)
    arms = [(config, tasks), (twin, _view(config, tasks))]

    def score(policy: ClonePolicy) -> float:
        accuracies = []
        for arm, arm_tasks in arms:
            trees = policy.engine(arm.rollout.budget, greedy).rollout(arm_tasks)
            score_trees(trees, arm_tasks, build_reward(arm))
            accuracies.append(statistics.fmean(float(t.correct) for t in trees))
        return min(accuracies)

    return score


def run(config: TrainConfig, log=say) -> dict:
    """All five steps; returns the timings and where everything was written.

    Steps, each timed, outputs under ``runs/<name>/``:

    1. warm start: SFT of a fresh model on teacher demonstrations of both styles (shared), and
       how it delegates before RL (spawn calls that parse, roots that delegate, clone accuracy);
    2. arm A, clones: GRPO from the warm start; the root may spawn (keyed_sum: it sees the keys
       only);
    3. arm B, monolithic: GRPO from the same warm start on the same tasks seen through the task
       source's monolithic view (keyed_sum: the lists printed in the prompt), spawning disabled,
       the same reward minus its clone terms, the same steps, prompts and trees per prompt;
    4. each arm's held-out reward against its own SFT start, sampled as in training (the
       quantity RL optimises, on tasks it never saw); then the evaluation at matched
       total-token budgets, in distribution and out of distribution: clones (A), monolithic
       (B), self-consistency over k samples of B, and both styles of the warm start alone;
    5. ``report.md``: tables with confidence intervals, Pareto plots, training curves, the
       frontier verdicts and example trees (text, and ``trace.html``).

    With ``trainer.resume=true`` the warm start saved in ``runs/<name>/sft`` is reused and each
    arm continues from its latest checkpoint (a finished arm trains no more), so a stopped run
    resumes, and a finished one can be measured again on other ``eval`` settings without
    training; the warm-start check, the held-out reward and the evaluation always run.

    Simplification: every node of both arms has the same per-node budgets (generation and
    context); the total per-tree budget is what the evaluation matches.

    ``warm_start.policy``, when set, is a policy folder from an earlier warm start
    (``runs/<name>/sft``) that both arms start from instead of running step 1 again.
    """
    settings = config.eval
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    if config.trainer.cpu_threads:
        torch.set_num_threads(config.trainer.cpu_threads)

    twin = monolithic_twin(config)
    validate(twin)  # a twin that cannot run fails here, before any compute
    check_resume(config)
    start = time.perf_counter()
    with timed(timings, "warm start (SFT)", log):
        warm_start_folder(config, out / "sft", log, score=validation_score(config))
    with timed(timings, "warm-start check", log):
        checked = warm_start_check(config, settings, out / "sft")
    log(f"warm-start check: {json.dumps(checked)}")
    with timed(timings, "GRPO, clones", log):
        clones, clones_history = train_arm(config, out / "sft", out / "clones")
    with timed(timings, "GRPO, monolithic", log):
        mono, mono_history = train_arm(twin, out / "sft", out / "monolithic",
                                       monolithic_view(config))

    with timed(timings, "held-out reward", log):
        sft = load_policy(config, out / "sft")
        tasks = evaluation_splits(config, settings)["in-distribution"]
        heldout = {
            "clones": held_out(config, clones, tasks, settings).difference(
                held_out(config, sft, tasks, settings)),
            "monolithic": held_out(twin, mono, _view(config, tasks), settings).difference(
                held_out(twin, sft, _view(config, tasks), settings)),
        }
        (out / "heldout.json").write_text(json.dumps(heldout, indent=2))
    log(f"held-out reward: {json.dumps(heldout)}")
    with timed(timings, "evaluation", log):
        results = evaluate_arms(config, settings, sft, clones, mono, out / "eval")

    timings["total"] = time.perf_counter() - start
    report = write_repro_report(out, config, twin, settings, results, heldout, clones_history,
                                mono_history, timings, checked)
    log(f"report: {report}")
    return {"timings": timings, "report": str(report), "results": results, "heldout": heldout}


def warm_start_check(config: TrainConfig, settings: EvaluationConfig,
                     folder: Path) -> dict[str, dict]:
    """How the warm start saved in ``folder`` delegates before RL (`delegation_stats`: spawn
    calls that parse, roots that delegate, clones that answer as the teacher would), on each
    held-out split sampled as training samples (clone arm's budget and temperature,
    ``reward_samples`` trees per task); written to ``warm_start.json``. Empty without a
    teacher."""
    section = config.warm_start
    if section.tasks is None:
        return {}
    policy = load_policy(config, folder)
    engine = training_engine(config, policy, seed=config.trainer.seed + 2)
    teacher = TEACHERS[section.teacher](**section.teacher_params)
    checked = {}
    for split, tasks in evaluation_splits(config, settings).items():
        trees = engine.rollout(tasks, samples_per_task=settings.reward_samples)
        checked[split] = delegation_stats(trees, policy.protocol, teacher).to_dict()
    (folder.parent / "warm_start.json").write_text(json.dumps(checked, indent=2))
    return checked


def evaluate_arms(config: TrainConfig, settings: EvaluationConfig, sft: ClonePolicy,
                  clones: ClonePolicy,
                  mono: ClonePolicy, out: Path):
    """Every method at every budget on the held-out in-distribution and OOD tasks."""
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
                    bootstrap_samples=settings.bootstrap_samples)


def main() -> None:
    """The Hydra app: ``experiment=`` defaults to cpu_repro."""
    register_schemas()
    hydra_app("train", TrainConfig, run, program="python -m selfcest.experiments.cpu_repro",
              defaults=[f"experiment={DEFAULT_EXPERIMENT}"])


if __name__ == "__main__":
    main()
