"""Hydra configs and CLIs: the shipped configs compose, bad ones fail before compute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, ListConfig, OmegaConf

from selfcest.cli import CONFIG_DIR, register_schemas, to_train_config
from selfcest.train.config import ConfigError, validate
from selfcest.train.trainer import GRPOTrainer, build_reward

register_schemas()
EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def train_config(*overrides: str):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return to_train_config(compose("train", overrides=list(overrides)))


def test_default_config_is_valid_and_typed():
    config = train_config()
    validate(config)
    assert config.model.name == "tiny" and config.rollout.budget.max_depth == 1
    assert config.algo.credit.strategy == "broadcast"


def fill_missing(node, value: str) -> list[str]:
    """Set every mandatory (???) leaf to ``value``; return their keys."""
    filled = []
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if OmegaConf.is_missing(node, key):
            node[key] = value
            filled.append(str(key))
        elif isinstance(node[key], (DictConfig, ListConfig)):
            filled += [f"{key}.{k}" for k in fill_missing(node[key], value)]
    return filled


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_composes(experiment, tmp_path):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    # GPU experiments take the model and data paths on the command line.
    required = fill_missing(cfg, str(tmp_path))
    assert all(k == "model.name" or "path" in k for k in required), required
    config = to_train_config(cfg)
    validate(config)
    assert callable(build_reward(config))  # the reward spec and its parameters load


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.budget.node_context=0", "rollout.budget.node_context must be >= 1"),
        ("rollout.budget.node_generation=5000", "rollout.budget.node_generation (5000) exceeds"),
        ("algo.credit.strategy=magic", "algo.credit.strategy must be one of"),
        ("algo.loss.aggregation=sum", "algo.loss.aggregation must be one of"),
        ("algo.loss.clip_low=1.5", "algo.loss.clip_low must be < 1"),
        ("model=hf", "model.name is required"),
        ("model.name=/no/such/model", "model.name must be one of"),
        ("trainer.trees_per_prompt=1", "trainer.trees_per_prompt must be >= 2"),
        ("trainer.tokens_per_micro_batch=100", "trainer.tokens_per_micro_batch (100) is smaller"),
        ("trainer.schedule=step", "trainer.schedule must be one of"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(train_config(override))


def test_unknown_keys_and_wrong_types_are_rejected_at_composition():
    with pytest.raises(ConfigCompositionException, match="trainer.foo"):
        train_config("trainer.foo=1")
    with pytest.raises(ConfigError, match="unknown key trainer.foo"):
        train_config("+trainer.foo=1")  # Hydra lets an appended key through; we do not
    with pytest.raises(ConfigCompositionException, match="trainer.steps=abc"):
        train_config("trainer.steps=abc")


def test_reward_that_cannot_load_stops_before_any_model(tmp_path):
    config = train_config("task.reward=no.such.module:reward", f"trainer.output_dir={tmp_path}")
    with pytest.raises(ConfigError, match="task.reward: reward spec 'no.such.module:reward'"):
        GRPOTrainer(config)
    assert not (tmp_path / "metrics.jsonl").exists()


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfcest.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_train_cli_runs_and_config_errors_exit_2(tmp_path):
    ok = run_cli("trainer.steps=1", "trainer.prompts_per_step=2", f"trainer.output_dir={tmp_path}/run",
                 "log.progress=false", "rollout.budget.node_generation=8", "rollout.budget.tree_generation=16",
                 cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    bad = run_cli("rollout.budget.node_context=0", cwd=tmp_path)
    assert bad.returncode == 2
    assert "configuration error: rollout.budget.node_context must be >= 1" in bad.stderr
