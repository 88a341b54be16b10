"""Typed configuration of ``selfcest-eval`` (Hydra composes it from ``configs/eval.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from selfcest.budget import Budget
from selfcest.configure import require, setting
from selfcest.eval.evaluate import MethodKind
from selfcest.rollout.backends.registry import BackendSettings
from selfcest.train.config import BudgetSweepConfig, TaskSourceConfig


@dataclass
class MethodConfig:
    """One way of spending a total-token budget on a task (`selfcest.eval.evaluate.Method`)."""

    name: str = setting(help="label in tables, plots and file names; unique within one evaluation")
    kind: MethodKind = setting(help="clones, monolithic or self_consistency")
    samples: int = setting(1, help="k: trees per task, for self_consistency only")
    budget: dict[str, int] = setting(help="overrides of the base budget's fields for this method",
                                     factory=dict)
    model: str | None = setting(None,
                                help="a policy folder of its own (null: the evaluated policy)")


# kw_only: the required policy follows the sweep's fields, which have defaults.
@dataclass(kw_only=True)
class EvalConfig(BudgetSweepConfig):
    """A saved policy across a budget sweep (`BudgetSweepConfig`), against baselines."""

    policy: str = setting(help="folder of a saved policy (ClonePolicy.save_pretrained)")
    splits: dict[str, TaskSourceConfig] = setting(help=(
        "split name -> task source, e.g. {id: {name: keyed_sum, params: {split: test}}} or a "
        "jsonl file"), factory=dict)
    methods: list[MethodConfig] = setting(help="the methods compared", factory=lambda: [
        MethodConfig("clones", MethodKind.clones),
        MethodConfig("monolithic", MethodKind.monolithic)])
    budget: Budget = setting(help="base budget every method starts from", factory=Budget)
    reward: str = setting("selfcest.rewards.arithmetic:arithmetic_reward", help=(
        "reward: package.module:function or path/to/file.py:function"))
    reward_params: dict[str, Any] = setting(help="keyword arguments of the reward factory",
                                            factory=lambda: {"cost": None})
    temperature: float = setting(0.0, help="sampling temperature (0 = greedy)")
    top_p: float = setting(1.0, help="nucleus sampling mass (1 = off)")
    top_k: int = setting(0, help="top-k sampling (0 = off)")
    seed: int = setting(0, help="seed of every rollout")
    rollout: BackendSettings = setting(help=(
        "the engine every policy decodes with: rollout.backend=hf|vllm and its settings (the "
        "training config's keys of the same names)"), factory=BackendSettings)
    device: str = setting("auto", help="where the policies run: auto (this process's GPU if there "
                                       "is one, else the CPU), cpu, cuda:1, ...")
    out_dir: str = setting("runs/eval",
                           help="where results.json/.csv/.md, the Pareto plots and the trees go")

    def check(self) -> None:
        super().check()
        require(bool(self.splits), "splits",
                "is empty: give at least one, e.g. splits.id.name=keyed_sum")
        require(bool(self.methods), "methods", "is empty: give at least one method")
