"""A tiny CPU reproduction starting from one saved warm start, shared by the experiments
that run RL from a saved warm start (rl_seeds, aggregation)."""

from __future__ import annotations

import pytest

from selfcest.experiments.common import compose
from selfcest.train.setup import run_warm_start

# The CPU reproduction at its smallest: 4 SFT steps validated on 2 tasks, then 2 prompts x 2
# trees per RL step and a few held-out tasks, 2 trees each.
TINY = ["warm_start.sft.steps=4", "warm_start.sft.sequences_per_step=4",
        "warm_start.validation_tasks=2", "trainer.steps=2",
        "trainer.prompts_per_step=2", "trainer.trees_per_prompt=2", "eval.tasks_per_split=4",
        "eval.reward_samples=2", "eval.bootstrap_samples=50", "log.progress=false"]


@pytest.fixture(scope="session")
def tiny_cpu_repro(tmp_path_factory):
    """``config(output_dir, *overrides)``: the tiny cpu_repro config, its ``warm_start.policy``
    one warm start saved once for the session."""
    warm_start = run_warm_start(
        compose("cpu_repro", [*TINY, f"trainer.output_dir={tmp_path_factory.mktemp('warm')}"]))

    def config(output_dir, *overrides):
        return compose("cpu_repro", [*TINY, f"warm_start.policy={warm_start}",
                                     f"trainer.output_dir={output_dir}",
                                     *overrides])
    return config
