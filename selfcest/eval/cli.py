"""selfcest-eval: evaluate saved policies across a budget sweep (`EvalConfig`,
``configs/eval.yaml``)."""

from __future__ import annotations

from dataclasses import asdict

from selfcest.configure import ConfigError, validate
from selfcest.eval.config import EvalConfig
from selfcest.eval.evaluate import run_evaluation
from selfcest.rewards.base import load_reward
from selfcest.tasks import load_tasks


def run_eval(config: EvalConfig) -> None:
    """Load the splits and the reward (failing with the key that is wrong), then sweep."""
    validate(config)
    try:
        reward = load_reward(config.reward, config.reward_params)
    except ValueError as error:
        raise ConfigError(f"reward: {error}") from None
    splits = {}
    for name, source in config.splits.items():
        try:
            tasks = load_tasks(source.name, **source.params)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"splits.{name}: {error}") from None
        splits[name] = config.first(tasks)
    methods = [{key: value for key, value in asdict(m).items() if value is not None}
               for m in config.methods]
    results = run_evaluation(
        config.policy, splits, config.budgets, methods, reward, config.out_dir,
        budget=config.budget, temperature=config.temperature, top_p=config.top_p,
        top_k=config.top_k, seed=config.seed, bootstrap_samples=config.bootstrap_samples,
        serving=config.rollout, device=None if config.device == "auto" else config.device,
    )
    print(f"selfcest-eval: {len(results.cells)} cells written to {config.out_dir}/results.md")
