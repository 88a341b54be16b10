"""A credit strategy is one registered function: the config accepts its name at once."""

from __future__ import annotations

import pytest

from selfcest.algo import credit
from selfcest.cli import register_schemas
from selfcest.configure import ConfigError, compose
from selfcest.train.config import TrainConfig
from selfcest.train.setup import build_trainer


@pytest.fixture
def halved():
    """A toy strategy, registered for one test: every clone gets half the root advantage."""
    calls = []

    @credit.register_credit("halved")
    def halved_credit(tree, root_advantage, terms, config):
        calls.append(tree.task_id)
        return {node: root_advantage / (2 if node != tree.ROOT_ID else 1) for node in tree.nodes}

    yield calls
    del credit.CREDIT["halved"]


def test_a_registered_strategy_is_selected_by_its_override_and_trains(halved, tmp_path):
    register_schemas()
    config = compose("train", [
        "model=tiny", "algo.credit.strategy=halved", "trainer.steps=1", "log.progress=false",
        f"trainer.output_dir={tmp_path}", "task.reward_params.cost={per_token:0.001}",
        "rollout.temperature=1.5"], TrainConfig)
    trainer = build_trainer(config)
    (metrics,) = trainer.train()
    trainer.close()
    assert halved and metrics["train/samples"] > 0


def test_a_name_is_registered_once_and_an_unknown_one_is_refused():
    with pytest.raises(ValueError, match="'broadcast' is already registered"):
        credit.register_credit("broadcast")(lambda tree, root_advantage, terms, config: {})
    register_schemas()
    with pytest.raises(ConfigError, match="algo.credit.strategy must be one of broadcast, ratio"):
        compose("train", ["model=tiny", "algo.credit.strategy=halved"], TrainConfig)
