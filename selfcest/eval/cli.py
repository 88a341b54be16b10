"""selfcest-eval: evaluate saved policies across a budget sweep (Hydra config `eval.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from selfcest.train.config import ConfigError


@dataclass
class EvalConfig:
    # Folder of a saved policy (ClonePolicy.save_pretrained); methods may name their own
    # ("model" in a method entry).
    policy: str = "???"
    # Split name -> {"name": task registered in selfcest.tasks, "params": {...}}, e.g.
    # {"id": {"name": "keyed_sum", "params": {"split": "test"}}} or a "jsonl" file.
    splits: dict[str, Any] = field(default_factory=dict)
    # Tasks used per split (the first N; 0 = all).
    limit: int = 0
    # Total generated tokens per task (Budget.tree_generation) of each point of the sweep.
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512])
    # Methods: {"name", "kind": clones | monolithic | self_consistency, "samples", "budget":
    # {overrides of the base budget}, "model": another policy folder}.
    methods: list[Any] = field(default_factory=lambda: [
        {"name": "clones", "kind": "clones"}, {"name": "monolithic", "kind": "monolithic"}])
    # Base budget (selfcest.budget.Budget fields) every method starts from.
    budget: dict[str, Any] = field(default_factory=dict)
    # Reward ("package.module:function" or "file.py:function") and its factory arguments.
    reward: str = "selfcest.rewards.arithmetic:arithmetic_reward"
    reward_params: dict[str, Any] = field(default_factory=lambda: {"cost": None})
    # Sampling: temperature 0 is greedy.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # Bootstrap resamples of every confidence interval.
    bootstrap_samples: int = 1000
    # Where results.json/.csv/.md, the Pareto plots and the trees go.
    out_dir: str = "runs/eval"


def run_eval_from_config(cfg) -> None:
    from selfcest.cli import to_object
    from selfcest.eval.evaluate import run_evaluation
    from selfcest.rewards.base import load_reward
    from selfcest.tasks import load_tasks

    config = to_object(cfg, EvalConfig)
    if not config.splits:
        raise ConfigError("splits is empty: give at least one, e.g. splits.id.name=keyed_sum")
    try:
        reward = load_reward(config.reward, config.reward_params)
    except ValueError as error:
        raise ConfigError(f"reward: {error}") from None
    splits = {}
    for name, source in config.splits.items():
        if not isinstance(source, dict) or "name" not in source:
            raise ConfigError(f"splits.{name} must be {{name: <task>, params: {{...}}}}; got {source!r}")
        try:
            tasks = load_tasks(source["name"], **dict(source.get("params") or {}))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"splits.{name}: {error}") from None
        splits[name] = tasks[: config.limit] if config.limit else tasks
    results = run_evaluation(
        config.policy, splits, config.budgets, config.methods, reward, config.out_dir,
        budget=config.budget, temperature=config.temperature, top_p=config.top_p,
        top_k=config.top_k, seed=config.seed, bootstrap_samples=config.bootstrap_samples,
    )
    print(f"selfcest-eval: {len(results.cells)} cells written to {config.out_dir}/results.md")
