"""The CPU reproduction: a small model learns to delegate; does it beat its monolithic twin?

The paper claims that a model trained end to end with clones (1) improves the
accuracy-cost Pareto frontier over monolithic baselines at matched inference budget and
(2) generalises out of distribution. This script tests both at laptop scale::

    python -m selfcest.experiments.cpu_repro                            # make run; ~10 min, 2 cores
    python -m selfcest.experiments.cpu_repro experiment=cpu_repro_quick   # the test-sized variant
    python -m selfcest.experiments.cpu_repro trainer.steps=40 rollout.budget.node_context=320
    python -m selfcest.experiments.cpu_repro warm_start.policy=runs/cpu_repro/sft  # reuse a start
    python -m selfcest.experiments.cpu_repro trainer.resume=true   # resume a stopped run

A Hydra app like ``selfcest-train`` (``--help`` lists every key): the experiment is
``configs/experiment/cpu_repro.yaml`` unless ``experiment=`` names another, its ``eval``
section sets the evaluation, and extra arguments override anything. Steps, each timed,
outputs under ``runs/<name>/``:

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
"""

from __future__ import annotations

import copy
import json
import shutil
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfcest.budget import Budget
from selfcest.cli import register_schemas
from selfcest.configure import ConfigError, hydra_app
from selfcest.configure import compose as compose_config
from selfcest.eval.delegation import delegation_stats
from selfcest.eval.evaluate import Method, evaluate
from selfcest.eval.stats import bootstrap_mean
from selfcest.experiments.report import write_repro_report
from selfcest.policy import ClonePolicy, default_device
from selfcest.rewards.base import score_trees
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.registry import BackendSettings
from selfcest.task import Task
from selfcest.tasks import TASKS, TEACHERS
from selfcest.train.checkpoint import (
    RESUME_LATEST,
    RESUME_OFF,
    config_changes,
    resolve_resume,
    saved_config,
)
from selfcest.train.config import (
    EvaluationConfig,
    TrainConfig,
    held_out_splits,
    load_split,
    validate,
)
from selfcest.train.logging import read_metrics
from selfcest.train.setup import (
    build_policy,
    build_reward,
    build_trainer,
    held_out_tasks,
    warm_start,
)

DEFAULT_EXPERIMENT = "cpu_repro"


@dataclass
class HeldOut:
    """One policy's held-out reward and accuracy under the training sampling and budget."""

    reward: list[float]  # per task, mean over its samples
    accuracy: list[float]  # per task, fraction of correct samples

    def difference(self, start: HeldOut, resamples: int = 2000, seed: int = 0) -> dict[str, float]:
        """Mean paired reward difference (self − start) over tasks, with a 95% bootstrap CI."""
        paired = bootstrap_mean([a - b for a, b in zip(self.reward, start.reward)], resamples,
                                seed=seed)
        return {"reward": statistics.fmean(self.reward), "start": statistics.fmean(start.reward),
                "difference": paired.value, "low": paired.low, "high": paired.high,
                "accuracy": statistics.fmean(self.accuracy),
                "start_accuracy": statistics.fmean(start.accuracy)}


def compose(experiment: str, overrides: list[str]) -> TrainConfig:
    """The training config of ``experiment`` (configs/experiment/<experiment>.yaml)."""
    register_schemas()
    return compose_config("train", [f"experiment={experiment}", *overrides], TrainConfig)


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


def say(message: str) -> None:
    print(message, flush=True)


def serving(config: TrainConfig, policy: ClonePolicy) -> ClonePolicy:
    """``policy``, decoding with the config's ``rollout.backend`` and its vLLM settings from
    now on. The hf backend keeps its default batch settings, as evaluations always used
    (``rollout.max_batch_size`` sizes training's batches; batching can move the last bits)."""
    policy.serving = BackendSettings(backend=config.rollout.backend, vllm=config.rollout.vllm)
    return policy


def load_policy(config: TrainConfig, folder: Path) -> ClonePolicy:
    """A saved policy on this process's device (its GPU if there is one), `serving` as
    configured."""
    return serving(config, ClonePolicy.from_pretrained(folder, device=default_device()))


def train_arm(config: TrainConfig, start: Path, output: Path, view=None,
              log=say) -> tuple[ClonePolicy, list[dict]]:
    """GRPO from the warm-start policy saved at ``start``, on the config's tasks seen through
    ``view`` (None: as they are); the trained policy is saved, and every step's metrics
    (``output/metrics.jsonl``) returned.

    With ``trainer.resume=true`` an arm continues from its latest checkpoint in ``output``: a
    stopped arm trains the steps it had left, a finished one none (what differs from the
    config it was trained under is logged, and refused unless ``trainer.resume_changes``
    allows it)."""
    config = copy.deepcopy(config)
    config.warm_start.policy = str(start)  # the shared warm start already happened
    config.trainer.output_dir = str(output)
    checkpoint = resolve_resume(config.trainer.resume, output)
    if checkpoint is not None:
        changed = config_changes(saved_config(checkpoint) or {}, asdict(config))
        differed = f"; its config differed in {', '.join(changed)}" if changed else ""
        log(f"resuming {output} from {checkpoint.name}{differed}")
    tasks = {}
    if view is not None:
        tasks["train_tasks"] = [view(task) for task in load_split(config.task, "train")]
        if config.trainer.eval_every:
            tasks["eval_tasks"] = [view(task) for task in load_split(config.task, "eval")]
    trainer = build_trainer(config, **tasks)
    try:
        ran = trainer.train()
    finally:
        trainer.close()
    if ran or not (output / "policy").exists():
        trainer.policy.save_pretrained(output / "policy")
    return serving(config, trainer.policy), read_metrics(output / "metrics.jsonl")


@contextmanager
def timed(timings: dict[str, float], phase: str, log=say):
    """Time the block into ``timings[phase]`` and say how long it took."""
    mark = time.perf_counter()
    yield
    timings[phase] = time.perf_counter() - mark
    log(f"{phase} done in {timings[phase]:.0f}s")


def warm_start_folder(config: TrainConfig, folder: Path, log=say, score=None) -> Path:
    """The warm-start policy saved in ``folder``: trained by SFT from a fresh model (validated
    by ``score`` if given, `selfcest.train.sft.train_sft`), copied from ``warm_start.policy``
    when that names an earlier one (with its ``sft.jsonl``), or, under
    ``trainer.resume=true``, the one an earlier run finished in ``folder``."""
    warm_started = config.warm_start.policy
    # written last
    if warm_started is None and resuming(config) and (folder / "sft.jsonl").exists():
        log(f"reusing the warm start in {folder}")
    elif warm_started is None:
        policy = build_policy(config)
        steps = config.warm_start.sft.steps

        def progress(step: int, metrics: dict) -> None:
            if "sft/validation" in metrics:
                log(f"warm start: SFT step {step}/{steps}, validation "
                    f"{metrics['sft/validation']:.3f}")
            elif step % max(1, steps // 10) == 0 or step == steps:
                log(f"warm start: SFT step {step}/{steps}, loss {metrics['sft/loss']:.3f}")

        history = warm_start(policy, config, held_out_tasks(config), log=progress, score=score)
        policy.save_pretrained(folder)
        with open(folder / "sft.jsonl", "w") as sft_log:
            sft_log.writelines(json.dumps({"step": n, **m}) + "\n" for n,
                               m in enumerate(history, 1))
    elif Path(warm_started).resolve() != folder.resolve():
        shutil.copytree(warm_started, folder, dirs_exist_ok=True)
    return folder


def run(config: TrainConfig, log=say) -> dict:
    """All five steps; returns the timings and where everything was written.

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
        warm_start_folder(config, out / "sft", log)
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
            "clones": held_out(config, clones, tasks,
                               settings).difference(held_out(config, sft, tasks, settings)),
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


def resuming(config: TrainConfig) -> bool:
    """Whether ``trainer.resume`` asks each run to continue from its latest checkpoint."""
    return config.trainer.resume in RESUME_LATEST


def check_resume(config: TrainConfig) -> None:
    """Several runs share one ``trainer.resume``: each resumes from its own latest checkpoint
    (true) or none (false); one checkpoint path cannot serve them all."""
    if config.trainer.resume not in (*RESUME_OFF, *RESUME_LATEST):
        raise ConfigError(f"trainer.resume={config.trainer.resume!r}: each run of this experiment "
                          "resumes from its own latest checkpoint; use trainer.resume=true")


def training_engine(config: TrainConfig, policy: ClonePolicy, seed: int):
    """An engine that samples as training does: the rollout budget, temperature, top-p, top-k."""
    rollout = config.rollout
    return policy.engine(rollout.budget,
                         SamplingParams(rollout.temperature, rollout.top_p, rollout.top_k),
                         seed=seed)


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


def evaluation_splits(config: TrainConfig, settings: EvaluationConfig) -> dict[str, list[Task]]:
    """The first ``tasks_per_split`` tasks of the held-out splits (``task.eval_params``, and
    ``task.ood_params`` when given); neither the warm start nor RL ever sees them."""
    names = {"eval": "in-distribution", "ood": "out-of-distribution"}
    return {names[split]: settings.first(load_split(config.task, split))
            for split in held_out_splits(config.task)}


def held_out(config: TrainConfig, policy: ClonePolicy, tasks: list,
             settings: EvaluationConfig) -> HeldOut:
    """The policy's reward on held-out tasks as training samples it: same temperature, same
    budget, ``reward_samples`` trees per task (what RL optimises, measured on new tasks)."""
    engine = training_engine(config, policy, seed=config.trainer.seed + 1)
    trees = engine.rollout(tasks, samples_per_task=settings.reward_samples)
    score_trees(trees, tasks, build_reward(config))
    reward, accuracy = [], []
    for i in range(len(tasks)):
        group = [t for t in trees if t.task_index == i]
        reward.append(statistics.fmean(t.reward for t in group))
        accuracy.append(statistics.fmean(float(t.correct) for t in group))
    return HeldOut(reward, accuracy)


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
