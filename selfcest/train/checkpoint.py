"""Checkpoints that resume a run exactly and load without unpickling anything.

A checkpoint is a folder ``checkpoints/step_000004/`` holding:

- ``model.safetensors``: the trainable parameters (all of them, or the LoRA adapter only);
- ``optimizer.pt``, ``scheduler.pt``: state dicts (tensors, numbers and parameter names
  only, loaded with ``torch.load(weights_only=True)``);
- ``rng_rank{r}.pt`` and ``state.json``: RNG states of every rank, the step, the data
  position and the backend's weight version.

Parameters and optimizer state are saved whole and keyed by parameter name (torch's
full-state-dict API), whether the run was single-process, DDP or FSDP-sharded: rank 0
writes them, and on resume rank 0 reads them and sends every process its part. So a
checkpoint resumes under any world size and sharding (the RNG states of ranks that did not
exist are drawn fresh).

It is written to ``step_000004.tmp`` and renamed when complete, so a run killed while
saving leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

CHECKPOINT_DIR = "checkpoints"


@dataclass
class TrainerState:
    """Where a run stands: what `state.json` records."""

    step: int  # training steps completed
    epoch: int  # passes over the training tasks started
    cursor: int  # position of the next task in this epoch's order
    weight_version: int  # the backend's weight version after the last sync


def trainable_names(model) -> set[str]:
    """Names of the parameters the optimizer updates (a shared tensor under its first name)."""
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def save_checkpoint(
    root: str | Path,
    state: TrainerState,
    model,
    optimizer: torch.optim.Optimizer,
    scheduler,
    rank: int = 0,
    world_size: int = 1,
    barrier=lambda: None,
    keep: int = 2,
) -> Path:
    """Write a checkpoint for ``state.step``; every rank calls this (rank 0 writes the model).

    ``model`` is the training model (sharded or not), ``optimizer`` its optimizer."""
    folder = Path(root) / CHECKPOINT_DIR / f"step_{state.step:06d}"
    tmp = folder.with_name(folder.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # Collectives: every rank gathers, rank 0 receives whole tensors on the CPU (frozen
    # weights stay where they are: a LoRA checkpoint moves the adapters only).
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=whole)
    optimizer_state = get_optimizer_state_dict(model, _torch_optimizer(optimizer), options=whole)
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        trainable = trainable_names(model)
        save_file({k: v.contiguous() for k, v in weights.items() if k in trainable}, tmp / "model.safetensors")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(
            json.dumps({**asdict(state), "world_size": world_size}, indent=2)
        )
    barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return folder


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    folder = Path(root) / CHECKPOINT_DIR
    if not folder.exists():
        return []
    return sorted(p for p in folder.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))


RESUME_OFF = (False, None, "", "false", "False")  # values of trainer.resume that start fresh
RESUME_LATEST = (True, "true", "True", "latest")  # ... that continue the latest checkpoint


def resolve_resume(resume, output_dir: str | Path) -> Path | None:
    """``false`` → None; ``true`` → the latest checkpoint of output_dir (None if there is none
    yet, so a restarted job starts fresh); a path → that checkpoint (it must exist)."""
    if resume in RESUME_OFF:
        return None
    if resume in RESUME_LATEST:
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(str(resume))
    if not (path / "state.json").exists():
        raise FileNotFoundError(
            f"trainer.resume={resume!r}: no checkpoint there (expected {path}/state.json); "
            "use trainer.resume=true for the latest checkpoint of trainer.output_dir"
        )
    return path


def load_checkpoint(folder: str | Path, model, optimizer, scheduler, rank: int = 0) -> TrainerState:
    """Restore parameters, optimizer, scheduler and this rank's RNG states; return the state.

    Every rank calls this; under several processes only rank 0 reads the weights and the
    optimizer state, and sends every process its part (its shard, under FSDP)."""
    folder = Path(folder)
    share = _distributed()
    weights, optimizer_state, problem = {}, {}, None
    if rank == 0 or not share:
        try:
            weights, optimizer_state = _read_checkpoint(folder, trainable_names(model))
        except Exception as error:  # any failure: relayed to every rank below, then raised
            problem = error
    if share:
        # Rank 0 tells every rank whether it could read the checkpoint, so that a bad one
        # fails on all of them instead of leaving the others waiting for its tensors.
        verdict = [None if problem is None else f"{type(problem).__name__}: {problem}"]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None and problem is None:
            problem = RuntimeError(f"rank 0 could not load checkpoint {folder}: {verdict[0]}")
    if problem is not None:
        raise problem
    # strict=False: the file holds the trainable parameters only, frozen ones stay as built.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=share, strict=False)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, _torch_optimizer(optimizer), optimizer_state, options=options)
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    rng_file = folder / f"rng_rank{rank}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    data = json.loads((folder / "state.json").read_text())
    data.pop("world_size", None)
    return TrainerState(**data)


def _read_checkpoint(folder: Path, expected: set[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights and optimizer state of a checkpoint, checked against the model's names."""
    weights = load_file(folder / "model.safetensors")
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(
            f"checkpoint {folder} does not match the model: missing {missing[:5]}, "
            f"unexpected {extra[:5]} (was it saved with another model or LoRA setting?)"
        )
    return weights, torch.load(folder / "optimizer.pt", weights_only=True)


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (the state-dict API needs its params)."""
    return getattr(optimizer, "optimizer", optimizer)


def _rng_state() -> dict:
    version, keys, position, has_gauss, cached = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "python": torch.tensor(py_internal, dtype=torch.int64),
        "python_meta": [py_version, py_gauss],
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_meta": [version, position, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    py_version, py_gauss = state["python_meta"]
    random.setstate((py_version, tuple(int(x) for x in state["python"]), py_gauss))
    version, position, has_gauss, cached = state["numpy_meta"]
    np.random.set_state((version, state["numpy_keys"].numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
