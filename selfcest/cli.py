"""Command-line entry points: selfcest-train, selfcest-sft, selfcest-eval, selfcest-view.

The Hydra apps read `configs/` of the repository (override the folder with Hydra's own
``--config-dir``). A config is turned into typed dataclasses and validated before anything
heavy starts; a bad key or value stops the run with a message that names it.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from selfcest.train.config import ConfigError, TrainConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def register_schemas() -> None:
    """Make the dataclass schemas known to Hydra, so unknown keys and wrong types fail."""
    from hydra.core.config_store import ConfigStore

    schema = OmegaConf.structured(TrainConfig)
    # On the command line a model must be chosen: a model group sets it, or model.name=...
    schema.model.name = "???"
    store = ConfigStore.instance()
    store.store(name="train_schema", node=schema)
    from selfcest.eval.cli import EvalConfig

    store.store(name="eval_schema", node=EvalConfig)


def to_object(cfg: DictConfig, kind: type):
    """A composed Hydra config as its validated dataclass (errors name the key)."""
    _check_keys(cfg, kind, "")
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as error:
        raise ConfigError(_explain(error)) from None
    except ValueError as error:
        raise ConfigError(_qualify(str(error))) from None
    if not isinstance(config, kind):
        raise ConfigError(f"the composed config is not a {kind.__name__} (is its schema in the defaults?)")
    return config


def to_train_config(cfg: DictConfig) -> TrainConfig:
    return to_object(cfg, TrainConfig)


def _check_keys(node, kind: type, prefix: str) -> None:
    """Refuse keys the dataclass does not have (Hydra lets ``+key=...`` through silently)."""
    if not dataclasses.is_dataclass(kind) or not isinstance(node, DictConfig):
        return
    hints = typing.get_type_hints(kind)
    for key in node.keys():
        if key not in hints:
            raise ConfigError(f"unknown key {prefix}{key}; known keys: {', '.join(sorted(hints))}")
        field_type = hints[key]
        inner = [t for t in typing.get_args(field_type) if dataclasses.is_dataclass(t)]
        target = field_type if dataclasses.is_dataclass(field_type) else (inner[0] if inner else None)
        if target is not None:
            _check_keys(node[key], target, f"{prefix}{key}.")


def _qualify(message: str) -> str:
    """Prefix section names to errors raised inside nested dataclasses ("budget.x" → "rollout.budget.x")."""
    for section, prefix in (("budget.", "rollout."), ("credit.", "algo."), ("loss.", "algo.")):
        if message.startswith(section):
            return prefix + message
    return message


def _explain(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    text = str(error).splitlines()[0]
    if "missing mandatory value" in text.lower():
        return f"{key} is required: set it on the command line, e.g. {key}=..."
    return f"{key}: {text}" if key else text


def _hydra_app(config_name: str, run):
    """Run ``run(cfg)`` as a Hydra app over `CONFIG_DIR`; config errors exit with code 2."""
    import hydra

    register_schemas()

    @hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base="1.3")
    def app(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except (ConfigError, FileNotFoundError) as error:
            print(f"selfcest: configuration error: {error}", file=sys.stderr)
            sys.exit(2)

    app()


def _train(cfg: DictConfig) -> None:
    from selfcest.train.trainer import GRPOTrainer

    config = to_train_config(cfg)
    trainer = GRPOTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()


def train() -> None:
    """selfcest-train: GRPO over clone trees (``python -m selfcest.train`` too)."""
    _hydra_app("train", _train)


def _sft(cfg: DictConfig) -> None:
    from selfcest.train.sft import run_warm_start

    run_warm_start(to_train_config(cfg))


def sft() -> None:
    """selfcest-sft: the ``warm_start`` section of a training config alone; the policy is
    saved to ``<trainer.output_dir>/sft`` (train from it with ``model.name=<that folder>``)."""
    _hydra_app("train", _sft)


def evaluate() -> None:
    """selfcest-eval: budget sweeps of a policy, baselines, Pareto plots."""
    from selfcest.eval.cli import run_eval_from_config

    _hydra_app("eval", run_eval_from_config)


def view() -> None:
    """selfcest-view trees.jsonl -o trace.html."""
    from selfcest.eval.view import main

    sys.exit(main())
