"""Command-line entry points: selfcest-train, selfcest-sft, selfcest-eval, selfcest-view.

The Hydra apps read `configs/` of the repository (override the folder with Hydra's own
``--config-dir``); ``--help`` prints every setting with its type, default and help text. A
config is built as typed dataclasses and validated before anything heavy starts; a bad key
or value stops the run with one line that names it (exit code 2).
"""

from __future__ import annotations

import sys

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from selfcest.configure import hydra_app
from selfcest.eval.cli import run_eval
from selfcest.eval.config import EvalConfig
from selfcest.eval.view import main as view_main
from selfcest.train.checkpoint import list_checkpoints
from selfcest.train.config import TrainConfig
from selfcest.train.setup import build_trainer, run_warm_start


def register_schemas() -> None:
    """Make the dataclass schemas known to Hydra, so unknown keys and wrong types fail."""
    schema = OmegaConf.structured(TrainConfig)
    # On the command line a model must be chosen: a model group sets it, or model.name=...
    schema.model.name = "???"
    store = ConfigStore.instance()
    store.store(name="train_schema", node=schema)
    store.store(name="eval_schema", node=EvalConfig)


def run_training(config: TrainConfig) -> None:
    """``selfcest-train``: build the trainer, train, release it. Stopped by a signal (with a
    checkpoint), it says so and exits 0 after SIGTERM, 130 after SIGINT."""
    trainer = build_trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    if trainer.stopped_by is not None:
        latest = list_checkpoints(config.trainer.output_dir)[-1]
        print(f"selfcest: stopped by {trainer.stopped_by} after step {trainer.state.step} of "
              f"{config.trainer.steps}; checkpoint {latest}; continue with trainer.resume=true",
              file=sys.stderr)
        sys.exit(130 if trainer.stopped_by == "SIGINT" else 0)


def train() -> None:
    """selfcest-train: GRPO over clone trees (``python -m selfcest.train`` too)."""
    register_schemas()
    hydra_app("train", TrainConfig, run_training, program="selfcest-train")


def sft() -> None:
    """selfcest-sft: the ``warm_start`` section of a training config alone; the policy is
    saved to ``<trainer.output_dir>/sft`` (start from it with ``warm_start.policy=<that
    folder>``)."""
    register_schemas()
    hydra_app("train", TrainConfig, run_warm_start, program="selfcest-sft")


def evaluate() -> None:
    """selfcest-eval: budget sweeps of a policy, baselines, Pareto plots."""
    register_schemas()
    hydra_app("eval", EvalConfig, run_eval, program="selfcest-eval")


def view() -> None:
    """selfcest-view trees.jsonl -o trace.html."""
    sys.exit(view_main())
