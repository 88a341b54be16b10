"""Building a run: mixed precision over float32 master weights, the accelerator's timeout and
device, and where the warm start and the refused configurations fail."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from test_trainer import small_config

from selfcest.configure import ConfigError, validate
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends import registry
from selfcest.train import distributed, setup
from selfcest.train.config import TaskSourceConfig, TrainConfig


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one state per process and refuses another mixed precision: start and
    leave the test without one."""
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_a_bfloat16_model_trains_float32_master_weights(tmp_path, fresh_accelerator_state):
    """An AdamW step at lr 1e-6 moves weights by less than bfloat16's resolution: with the
    parameters in bfloat16 it rounds away; the run keeps them float32 and computes in bfloat16."""
    config = small_config(tmp_path, steps=1, lr=1e-6)
    config.model.dtype = "bfloat16"
    trainer = setup.build_trainer(config)
    before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}
    history = trainer.train()
    trainer.close()
    after = dict(trainer.policy.model.named_parameters())
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) == len(before)
    assert trainer.accelerator.mixed_precision == "bf16"
    assert {p.dtype for p in trainer.policy.model.parameters()} == {torch.float32}
    # 16-bit numerics are not the rollout's: the old logprobs are recomputed, and the gap logged.
    assert trainer.recompute and 0 < history[
        0]["rollout/logprob_diff_mean"] <= history[0]["rollout/logprob_diff_max"]


def test_a_model_folder_loads_float32_master_weights_whatever_its_compute_dtype(
    tiny_policy, tmp_path):
    """``model=hf`` (the paper runs) says bfloat16: a folder's weights load in float32 all the
    same, and bfloat16 is what its passes compute in."""
    tiny_policy.save_pretrained(tmp_path / "model")
    config = TrainConfig()
    config.model.name, config.model.dtype = str(tmp_path / "model"), "bfloat16"
    policy = setup.build_policy(config)
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}


def test_float32_on_the_hf_backend_recomputes_nothing_and_logs_as_before(tmp_path):
    trainer = setup.build_trainer(small_config(tmp_path, steps=1))
    history = trainer.train()
    trainer.close()
    assert trainer.accelerator.mixed_precision == "no" and not trainer.recompute
    assert not any(key.startswith(("rollout/logprob_diff", "sync/")) for key in history[0])


def test_collectives_wait_as_long_as_configured(monkeypatch, tmp_path):
    """NCCL gives up after 10 minutes by default; followers wait for a node's whole rollout."""
    built = {}

    def recording(**kwargs):
        built.update(kwargs)
        return Accelerator(**kwargs)

    monkeypatch.setattr(distributed, "Accelerator", recording)
    config = small_config(tmp_path, steps=1, collective_timeout_s=5400)
    setup.build_trainer(config).close()
    (handler,) = built["kwargs_handlers"]
    assert handler.timeout.total_seconds() == 5400 and built["mixed_precision"] == "no"


def on_meta(monkeypatch) -> None:
    """Pretend the run's device is "meta", to see what is moved there."""
    monkeypatch.setattr(Accelerator, "device", property(lambda self: torch.device("meta")))


def test_the_warm_start_runs_on_the_runs_device(monkeypatch, tmp_path):
    on_meta(monkeypatch)
    seen = {}
    monkeypatch.setattr(setup, "logged_warm_start", lambda policy, *a: seen.setdefault(
        "device", next(policy.model.parameters()).device))
    monkeypatch.setattr(setup, "GRPOTrainer", lambda *a, **k: None)
    config = small_config(tmp_path)
    config.warm_start.tasks = TaskSourceConfig("keyed_sum", {"split": "train"})
    setup.build_trainer(config)
    assert seen["device"] == torch.device("meta")


def test_selfcest_sft_warm_starts_on_this_processs_gpu(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(setup, "default_device", lambda: torch.device("meta"))
    monkeypatch.setattr(setup, "logged_warm_start", lambda policy, *a: seen.setdefault(
        "device", next(policy.model.parameters()).device))
    monkeypatch.setattr(ClonePolicy, "save_pretrained", lambda self, path: None)
    config = small_config(tmp_path)
    config.warm_start.tasks = TaskSourceConfig("keyed_sum", {"split": "train"})
    setup.run_warm_start(config)
    assert seen["device"] == torch.device("meta")


def test_a_vllm_engine_per_node_must_span_the_node(monkeypatch):
    """vLLM's groups span every process, so one engine per node is a tensor-parallel engine
    over its processes; at tensor_parallel_size 1 the node's other processes hung."""
    # vLLM "installed"
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    config = TrainConfig()
    config.rollout.engine_per_node = True
    validate(config)  # hf: the first process decodes for the node
    config.rollout.backend = "vllm"
    with pytest.raises(ConfigError, match="^rollout.engine_per_node=true with backend=vllm needs "
                                          "vllm.tensor_parallel_size"):
        validate(config)
    config.rollout.vllm.tensor_parallel_size = 8
    validate(config)
