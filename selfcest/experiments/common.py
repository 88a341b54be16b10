"""What the experiments share: composing a config, saying and timing what happens, the
warm start, training an arm, loading a saved policy and measuring its held-out reward."""

from __future__ import annotations

import copy
import json
import shutil
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from selfcest.cli import register_schemas
from selfcest.configure import ConfigError
from selfcest.configure import compose as compose_config
from selfcest.eval.stats import bootstrap_mean
from selfcest.policy import ClonePolicy, default_device
from selfcest.rewards.base import score_trees
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.registry import BackendSettings
from selfcest.task import Task
from selfcest.train.checkpoint import (
    RESUME_LATEST,
    RESUME_OFF,
    config_changes,
    read_best,
    read_evaluations,
    resolve_resume,
    saved_config,
)
from selfcest.train.config import EvaluationConfig, TrainConfig, held_out_splits, load_split
from selfcest.train.logging import read_metrics
from selfcest.train.setup import (
    build_policy,
    build_reward,
    build_trainer,
    held_out_tasks,
    warm_start,
)


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


def train_arm(config: TrainConfig, start: Path, output: Path, view=None, log=say,
              eval_tasks: list[Task] | None = None) -> tuple[ClonePolicy, list[dict]]:
    """GRPO from the warm-start policy saved at ``start``, on the config's tasks seen through
    ``view`` (None: as they are), evaluated every ``trainer.eval_every`` steps on
    ``eval_tasks`` (None: the config's eval split); the trained policy is saved (the best
    evaluated one under ``trainer.keep_best``), and every step's metrics
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
        if eval_tasks is None and config.trainer.eval_every:
            eval_tasks = load_split(config.task, "eval")
    if eval_tasks is not None:
        tasks["eval_tasks"] = eval_tasks if view is None else [view(t) for t in eval_tasks]
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
    by ``score`` if given, `validated_sft`), copied from ``warm_start.policy`` when that names
    an earlier one (with its ``sft.jsonl``), or, under ``trainer.resume=true``, the one an
    earlier run finished in ``folder``."""
    warm_started = config.warm_start.policy
    # sft.jsonl is written last: with it the folder holds a finished warm start.
    if warm_started is None and resuming(config) and (folder / "sft.jsonl").exists():
        log(f"reusing the warm start in {folder}")
    elif warm_started is None:
        policy, history = validated_sft(config, log, score)
        policy.save_pretrained(folder)
        with open(folder / "sft.jsonl", "w") as sft_log:
            sft_log.writelines(json.dumps(line) + "\n" for line in history)
    elif Path(warm_started).resolve() != folder.resolve():
        shutil.copytree(warm_started, folder, dirs_exist_ok=True)
    return folder


def validated_sft(config: TrainConfig, log=say, score=None) -> tuple[ClonePolicy, list[dict]]:
    """SFT from a fresh model, and from another fresh one (`restart_config`) while no
    validation has reached ``sft.validation_target``, up to ``warm_start.restarts`` times.
    Returns the best-scoring policy of all attempts and every step's metrics, each with its
    ``attempt`` and ``step`` (within the attempt)."""
    section = config.warm_start
    steps, target = section.sft.steps, section.sft.validation_target
    exclude = held_out_tasks(config)
    best: tuple[float, ClonePolicy] | None = None
    history: list[dict] = []
    for attempt in range(section.restarts + 1):
        def progress(step: int, metrics: dict) -> None:
            where = f"SFT step {step}/{steps}" + (f" (restart {attempt})" if attempt else "")
            if "sft/validation" in metrics:
                log(f"warm start: {where}, validation {metrics['sft/validation']:.3f}")
            elif step % max(1, steps // 10) == 0 or step == steps:
                log(f"warm start: {where}, loss {metrics['sft/loss']:.3f}")

        trial = restart_config(config, attempt)
        policy = build_policy(trial)
        metrics = warm_start(policy, trial, exclude, log=progress, score=score)
        history += [{"attempt": attempt, "step": n, **m} for n, m in enumerate(metrics, 1)]
        value = max((m["sft/validation"] for m in metrics if "sft/validation" in m),
                    default=None)
        if value is None:  # no validation: the one attempt is the warm start
            return policy, history
        if best is None or value > best[0]:
            best = (value, policy)
        if best[0] >= target:
            break
        if attempt < section.restarts:
            log(f"warm start: best validation {value:.3f} < target {target}: SFT again from "
                f"a fresh model (restart {attempt + 1} of {section.restarts})")
    return best[1], history


def kept_checkpoint(folder: Path) -> dict | None:
    """The checkpoint a validated warm start in ``folder`` kept, read from its ``sft.jsonl``:
    its ``attempt``, ``step`` and ``validation`` (the first best score, as `train_sft` and
    `validated_sft` keep it) and the ``attempts`` SFT made. None without validations."""
    path = folder / "sft.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    scored = [line for line in lines if "sft/validation" in line]
    if not scored:
        return None
    best = max(scored, key=lambda line: line["sft/validation"])  # max keeps the first best
    return {"attempt": best.get("attempt", 0), "step": best["step"],
            "validation": best["sft/validation"],
            "attempts": 1 + max(line.get("attempt", 0) for line in lines)}


def kept_evaluation(folder: Path) -> dict | None:
    """What ``trainer.keep_best`` kept in the RL arm ``folder``: the ``step`` (0: the starting
    weights) and ``value`` of its best evaluation, and every evaluation it compared
    (``evaluations``: step and value). None when the arm kept no best."""
    best = read_best(folder)
    if best is None:
        return None
    return {"step": best["step"], "value": best["value"], "evaluations": read_evaluations(folder)}


def restart_config(config: TrainConfig, attempt: int) -> TrainConfig:
    """The config of SFT attempt ``attempt`` (0: ``config`` itself): another model init
    (``model.init_seed + 1000 attempt``, far from the seeds other runs use) and another
    sequence order (``sft.seed + attempt``)."""
    if not attempt:
        return config
    section = config.warm_start
    return replace(config,
                   model=replace(config.model, init_seed=config.model.init_seed + 1000 * attempt),
                   warm_start=replace(section, sft=replace(section.sft,
                                                           seed=section.sft.seed + attempt)))


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
