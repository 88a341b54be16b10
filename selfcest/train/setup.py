"""Building a run from its config: policy, reward, tasks, warm start, and the trainer.

This module sits above `selfcest.train.trainer` and `selfcest.train.sft`: `build_trainer`
turns a `TrainConfig` into a ready `GRPOTrainer` (what ``selfcest-train`` runs), and
`run_warm_start` is ``selfcest-sft``. Everything a bad config can break fails here, before
any model is built: validation, the reward import, the task files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from selfcest.configure import ConfigError
from selfcest.policy import SIZES, ClonePolicy, apply_lora, default_device
from selfcest.protocol import Protocol
from selfcest.rewards.base import RewardFn, load_reward
from selfcest.rewards.guard import RewardProcess
from selfcest.task import Task
from selfcest.train.checkpoint import check_resume_config, resolve_resume
from selfcest.train.config import (
    SMOLLM2,
    ProtocolName,
    TrainConfig,
    held_out_splits,
    load_split,
    validate,
)
from selfcest.train.distributed import (
    COMPUTE_DTYPES,
    MIXED_PRECISION,
    decided_by_main,
    start_accelerator,
)
from selfcest.train.lifecycle import RunLock
from selfcest.train.sft import train_sft
from selfcest.train.sharding import check_model, is_sharded
from selfcest.train.traces import demonstrations
from selfcest.train.trainer import GRPOTrainer
from selfcest.tree import CloneTree

logger = logging.getLogger(__name__)


def build_policy(config: TrainConfig, name: str | None = None) -> ClonePolicy:
    """The policy ``config.model`` describes: a built-in tiny size, SmolLM2, or a model folder
    (``name``, when given, replaces ``model.name``: a saved warm start, say). Its parameters
    are float32 whatever ``model.dtype`` computes in (they are the master weights)."""
    model = config.model
    name = name or model.name
    protocol, dtype = ProtocolName(model.protocol).value, torch.float32
    prompts = {"root_system": model.root_system, "clone_system": model.clone_system}
    if name in SIZES:
        policy = ClonePolicy.build_tiny(seed=model.init_seed, size=name, protocol=protocol,
                                        **prompts)
        if model.lora is not None:
            required = list(policy.protocol.required_tokens)
            policy.model = apply_lora(policy.model, model.lora,
                                      policy.tokenizer.convert_tokens_to_ids(required))
        return policy
    if name == SMOLLM2:
        return ClonePolicy.from_smollm2(protocol=protocol, lora=model.lora, dtype=dtype, **prompts)
    gguf = {"gguf_file": model.gguf_file} if model.gguf_file and name == model.name else {}
    return ClonePolicy.from_pretrained(name, protocol=protocol, lora=model.lora, dtype=dtype,
                                       **prompts, **gguf)


def build_reward(config: TrainConfig) -> RewardFn:
    """The reward named by ``task.reward`` (a factory is called with ``task.reward_params``),
    loaded here first so that a bad spec fails before any compute; with
    ``task.reward_timeout_s``, called in a worker process (`RewardProcess`)."""
    task = config.task
    try:
        reward = load_reward(task.reward, task.reward_params)
    except ValueError as error:
        raise ConfigError(f"task.reward: {error}") from None
    if task.reward_timeout_s is None:
        return reward
    return RewardProcess(task.reward, task.reward_params, task.reward_timeout_s)


def held_out_tasks(config: TrainConfig) -> list[Task]:
    """A config's held-out tasks, which a warm start must not demonstrate: its evaluation split
    (none when ``task.eval_params`` is empty, as the evaluation then reads the training split)
    and its OOD split (``task.ood_params``)."""
    return [held for split in held_out_splits(config.task)
            for held in load_split(config.task, split)]


def warm_start(
    policy: ClonePolicy,
    config: TrainConfig,
    exclude: Sequence[Task] = (),
    log: Callable[[int, dict[str, float]], None] | None = None,
    score: Callable[[ClonePolicy], float] | None = None,
) -> list[dict[str, float]]:
    """Build the demonstrations the ``warm_start`` section describes (leaving out any task of
    ``exclude``) and fit ``policy`` to them, validated by ``score`` if given (`train_sft`);
    returns per-step metrics."""
    trees = warm_start_trees(config, policy.protocol, exclude)
    return train_sft(policy, trees, config.warm_start.sft, log=log, score=score)


def warm_start_trees(config: TrainConfig, protocol: Protocol,
                     exclude: Sequence[Task] = ()) -> list[CloneTree]:
    """The demonstrations of the ``warm_start`` section: its ``tasks`` under its budget, then
    its ``direct_tasks`` under the same budget with spawning off."""
    section = config.warm_start
    budget = section.budget or config.rollout.budget
    trees = demonstrations(section.tasks, section.teacher, section.teacher_params, protocol, budget,
                           exclude)
    if section.direct_tasks is not None:
        trees += demonstrations(section.direct_tasks, section.teacher, section.teacher_params,
                                protocol,
                                dataclasses.replace(budget, max_depth=0), exclude)
    return trees


def logged_warm_start(policy: ClonePolicy, config: TrainConfig,
                      folder: Path) -> list[dict[str, float]]:
    """`warm_start` leaving out the config's held-out tasks, with its loss curve written to
    ``folder/sft.jsonl`` (one JSON line per step); returns the per-step metrics."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sft.jsonl", "w") as log:
        return warm_start(policy, config, held_out_tasks(config),
                          log=lambda step, m: log.write(json.dumps({"step": step, **m}) + "\n"))


def run_warm_start(config: TrainConfig) -> Path:
    """``selfcest-sft``: warm-start the config's model as its ``warm_start`` section says
    (leaving out its held-out tasks), and save the policy and the loss curve (``sft.jsonl``)
    under ``<trainer.output_dir>/sft``; returns that folder."""
    validate(config)
    if not config.warm_start.tasks:
        raise ConfigError("warm_start.tasks is empty: give a task source for the teacher to "
                          "demonstrate")
    out = Path(config.trainer.output_dir) / "sft"
    if config.trainer.cpu_threads:
        torch.set_num_threads(config.trainer.cpu_threads)
    policy = build_policy(config)
    device = default_device()
    policy.model.to(device)
    precision = MIXED_PRECISION[str(config.model.dtype)]
    autocast = (contextlib.nullcontext() if precision == "no"
                else torch.autocast(device.type, COMPUTE_DTYPES[precision]))
    with autocast:
        logged_warm_start(policy, config, out)
    policy.save_pretrained(out)
    return out


def build_trainer(
    config: TrainConfig,
    *,
    policy: ClonePolicy | None = None,
    train_tasks: Sequence[Task] | None = None,
    eval_tasks: Sequence[Task] | None = None,
    reward_fn: RewardFn | None = None,
    backend=None,
) -> GRPOTrainer:
    """A `GRPOTrainer` for ``config``, ready to ``train()``.

    Each part given replaces the one the config describes (a policy from a notebook, tasks
    of your own, a reward function object, a backend). The order: validate; the reward and
    the tasks; the accelerator (refusing unsupported distributed setups); the output folder's
    lock and the checkpoint to resume, whose config must match (`resume_checkpoint`); the
    policy (``warm_start.policy`` if set, else ``model``); the warm start, unless resuming or
    starting from a saved one (every process runs it identically, so they agree); then the
    trainer, which holds the lock until ``close()``.
    """
    validate(config)
    trainer = config.trainer
    if reward_fn is not None and config.task.reward_timeout_s is not None:
        raise ConfigError("task.reward_timeout_s runs the reward task.reward names in a worker "
                          "process; a reward_fn given in Python runs in this one: pass none, or "
                          "set task.reward_timeout_s=null")
    reward_fn = reward_fn or build_reward(config)
    train_tasks = list(train_tasks) if train_tasks is not None else load_split(config.task, "train")
    if eval_tasks is None:
        eval_tasks = load_split(config.task, "eval") if trainer.eval_every else []
    if trainer.cpu_threads:
        torch.set_num_threads(trainer.cpu_threads)
    accelerator = start_accelerator(trainer.seed, str(config.model.dtype),
                                    trainer.collective_timeout_s)
    held: list[RunLock] = []

    def claim_output() -> Path | None:
        held.append(RunLock.acquire(trainer.output_dir))
        return resume_checkpoint(config)

    try:
        resume_from = decided_by_main(accelerator, claim_output)
        saved = config.warm_start.policy
        policy = policy or build_policy(config, saved)
        policy.model.to(accelerator.device)
        if is_sharded(accelerator):
            check_model(policy.model)
        if resume_from is None and config.warm_start.tasks and saved is None:
            with accelerator.autocast():  # the run's mixed precision (none in float32)
                logged_warm_start(policy, config, Path(trainer.output_dir))
            if backend is not None:
                backend.sync_weights(policy.model)  # it was built before the warm start
        return GRPOTrainer(config, accelerator, policy, train_tasks, reward_fn,
                           eval_tasks=list(eval_tasks)[: config.task.eval_size], backend=backend,
                           resume_from=resume_from, lock=held[0] if held else None)
    except BaseException:
        for lock in held:
            lock.release()
        raise


def resume_checkpoint(config: TrainConfig) -> Path | None:
    """The checkpoint ``trainer.resume`` names (`resolve_resume`), refused if the config
    differs from the one it was trained under in a key ``trainer.resume_changes`` does not
    allow; the allowed changes are logged."""
    trainer = config.trainer
    folder = resolve_resume(trainer.resume, trainer.output_dir)
    if folder is not None:
        changes = check_resume_config(folder, dataclasses.asdict(config), trainer.resume_changes)
        for key, (before, now) in changes.items():
            logger.info("resuming %s with %s changed: %r -> %r (trainer.resume_changes)", folder,
                        key, before, now)
    return folder
