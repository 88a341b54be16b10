"""One registry of backends: every entry point honours ``rollout.backend``, and a backend
whose package is missing fails before any compute, naming the key and the install step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from selfcest.configure import ConfigError, validate
from selfcest.eval.cli import run_eval
from selfcest.eval.config import EvalConfig
from selfcest.experiments.common import compose
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends import registry
from selfcest.rollout.backends.hf import HFBackend
from selfcest.rollout.backends.registry import BackendSettings, serve
from selfcest.train import setup
from selfcest.train.config import TaskSourceConfig, TrainConfig

INSTALL = r"vllm: the vLLM backend needs vLLM: pip install 'selfcest\[vllm\]'"


@pytest.fixture
def without_vllm(monkeypatch):
    """vLLM not installed, whatever this environment has."""
    find_spec = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None if name == "vllm"
                        else find_spec(name))


def test_the_hf_backend_is_built_from_its_settings(tiny_policy):
    backend = serve(tiny_policy, BackendSettings(max_batch_size=3, prefix_cache_mb=0))
    assert isinstance(backend, HFBackend) and backend.model is tiny_policy.model
    assert backend.max_batch_size == 3 and backend.prefix_cache is None
    assert serve(tiny_policy, BackendSettings()) is not backend  # cheap: a new one each time
    assert isinstance(tiny_policy.backend(),
                      HFBackend) and isinstance(tiny_policy.backend("hf"), HFBackend)


def test_training_without_vllm_fails_before_any_model_is_built(without_vllm, monkeypatch, tmp_path):
    monkeypatch.setattr(setup, "build_policy", lambda *a: pytest.fail("a model was built"))
    config = TrainConfig()
    config.rollout.backend = "vllm"
    config.trainer.output_dir = str(tmp_path)
    with pytest.raises(ConfigError, match=f"^rollout.backend={INSTALL}"):
        setup.build_trainer(config)


def test_every_experiment_without_vllm_fails_as_its_config_is_checked(without_vllm):
    """Every Hydra app validates its config before it runs anything (`configure.hydra_app`)."""
    for experiment in ("cpu_repro_quick", "controller_quick", "paper_arithmetic"):
        config = compose(experiment, ["rollout=vllm", "model.name=tiny"])
        with pytest.raises(ConfigError, match=f"^rollout.backend={INSTALL}"):
            validate(config)


@pytest.mark.skipif(registry.importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed here")
def test_the_controller_command_without_vllm_stops_before_its_warm_start(tmp_path):
    """The controller's run starts with its warm start; the app's validation comes first."""
    done = subprocess.run([sys.executable, "-m", "selfcest.experiments.controller",
                           "experiment=controller_quick",
                           "rollout=vllm", f"trainer.output_dir={tmp_path}"], capture_output=True,
                          text=True,
                          timeout=300)
    assert done.returncode == 2 and "pip install 'selfcest[vllm]'" in done.stderr
    assert not (tmp_path / "sft").exists()  # (Hydra wrote its own .hydra folder there)


def test_an_evaluation_without_vllm_fails_before_the_policy_is_read(without_vllm, tmp_path):
    config = EvalConfig(policy=str(tmp_path / "no-such-policy"),
                        splits={"id": TaskSourceConfig("keyed_sum", {})},
                        rollout=BackendSettings(backend="vllm"))
    with pytest.raises(ConfigError, match=f"^rollout.backend={INSTALL}"):
        run_eval(config)


def test_a_notebook_without_vllm_is_told_the_install_step(without_vllm):
    policy = ClonePolicy.build_tiny()
    with pytest.raises(ConfigError, match=f"^backend={INSTALL}"):
        policy.backend("vllm")
    with pytest.raises(ConfigError, match=f"^backend={INSTALL}"):
        policy.solve("Add all numbers in L1.", context={"L1": "1 2"}, backend="vllm")


def test_an_unknown_backend_is_refused_with_the_choices():
    settings = BackendSettings(backend="tgi")
    with pytest.raises(ConfigError, match="backend must be one of hf, vllm"):
        validate(settings)
