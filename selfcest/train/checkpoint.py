"""Checkpoints that resume a run exactly, load without unpickling anything, and are checked.

A checkpoint is a folder ``checkpoints/step_000004/`` holding:

- ``model.safetensors``: the trainable parameters (all of them, or the LoRA adapter only);
- ``optimizer.pt``, ``scheduler.pt``: state dicts (tensors, numbers and parameter names
  only, loaded with ``torch.load(weights_only=True)``);
- ``rng_rank{r}.pt`` and ``state.json``: RNG states of every rank, the step, the data
  position and the backend's weight version;
- ``config.json``: the run's config, which a resume must match (`check_resume_config`);
- ``manifest.json``, written last: every other file's size and SHA-256.

`save_checkpoint` says how a checkpoint is saved whole and atomically, how it resumes under
any world size, and how a damaged one is set aside on resume (`resolve_resume`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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

from selfcest.configure import ConfigError, RunError

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
CONFIG = "config.json"
BEST_DIR = "best"  # trainer.keep_best's checkpoint, under the output folder
BEST_RECORD = "best.json"
EVALUATIONS = "evaluations.jsonl"  # every evaluation keep_best compared, beside the best
_STEP_FOLDER = re.compile(r"step_\d{6}")
# Keys a resumed run may change without asking: where it writes and how often it saves,
# its loggers and the evaluation experiments run afterwards; none changes what is trained.
UNCHECKED_KEYS = ("trainer.output_dir", "trainer.resume", "trainer.resume_changes",
                  "trainer.save_every", "trainer.save_final", "trainer.keep_checkpoints", "log.",
                  "eval.")


class CheckpointError(RunError):
    """A checkpoint that could not be written, or no sound one to resume from."""


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


def _agreed(action: Callable[[], Any], where: str) -> None:
    """Run ``action`` on this rank; if it fails on any rank, raise `CheckpointError` on all
    of them (a rank left waiting for one that failed would hang). Also a barrier."""
    problem = None
    try:
        action()
    except Exception as error:  # a full disk surfaces as OSError, RuntimeError or SafetensorError
        problem = f"{type(error).__name__}: {error}"
    verdicts = [problem]
    if _distributed():
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
    failed = [v for v in verdicts if v is not None]
    if failed:
        raise CheckpointError(f"{where}: {failed[0]}")


def save_checkpoint(
    root: str | Path,
    state: TrainerState,
    model,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    rank: int = 0,
    world_size: int = 1,
    keep: int = 2,
    config: dict | None = None,
) -> Path:
    """Write a checkpoint for ``state.step``; every rank calls this (rank 0 writes the model).

    ``model`` is the training model (sharded or not), ``optimizer`` its optimizer (None:
    weights only, which no resume can start from; reading an optimizer's state before its
    first step would create it, moving that step), ``config`` the run's config as JSON-ready
    data. A save that fails (a full disk, an unwritable
    folder) leaves no partial folder and raises `CheckpointError` naming the cause and the
    checkpoint still there.

    Parameters and optimizer state are saved whole and keyed by parameter name (torch's
    full-state-dict API), whether the run was single-process, DDP or FSDP-sharded: rank 0
    writes them, and on resume rank 0 reads them and sends every process its part. So a
    checkpoint resumes under any world size and sharding (the RNG states of ranks that did not
    exist are drawn fresh).

    It is written to ``step_000004.tmp``, flushed to disk and renamed when complete, so a run
    killed or out of disk space while saving leaves the previous checkpoint as the latest one;
    a failed save raises `CheckpointError` naming the cause. On resume a checkpoint whose files
    do not match its manifest (truncated, altered) is set aside as ``step_000004.damaged`` and
    the one before it is used, with a warning; if none is left the resume is refused.
    """
    folder = Path(root) / CHECKPOINT_DIR / f"step_{state.step:06d}"
    tmp = folder.with_name(folder.name + ".tmp")
    previous = list_checkpoints(root)
    kept = (f"the previous checkpoint {previous[-1]} is intact" if previous
            else "no earlier checkpoint exists")
    try:
        _agreed(lambda: rank == 0 and _fresh_folder(tmp), f"could not create {tmp}")
        # Collectives: every rank gathers, rank 0 receives whole tensors on the CPU (frozen
        # weights stay where they are: a LoRA checkpoint moves the adapters only).
        whole = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        weights = get_model_state_dict(model, options=whole)
        optimizer_state = (None if optimizer is None else
                           get_optimizer_state_dict(model, _torch_optimizer(optimizer),
                                                    options=whole))

        def write() -> None:
            torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
            if rank == 0:
                trainable = trainable_names(model)
                save_file({k: v.contiguous() for k, v in weights.items() if k in trainable},
                          tmp / "model.safetensors")
                if optimizer_state is not None:
                    torch.save(optimizer_state, tmp / "optimizer.pt")
                    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
                state_json = {**asdict(state), "world_size": world_size}
                (tmp / "state.json").write_text(json.dumps(state_json, indent=2))
                if config is not None:
                    (tmp / CONFIG).write_text(json.dumps(config, indent=2, default=str))

        _agreed(write, f"could not write checkpoint {folder}")
        _agreed(lambda: rank == 0 and _publish(tmp, folder),
                f"could not complete checkpoint {folder}")
    except CheckpointError as error:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{error}; {kept}") from None
    if rank == 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _fresh_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _publish(tmp: Path, folder: Path) -> None:
    """Write the manifest, flush everything to disk, and rename ``tmp`` to ``folder``."""
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps({"files": manifest}, indent=2))
    for path in [*files, tmp / MANIFEST, tmp]:
        _fsync(path)
    if folder.exists():  # the same step saved again: replace it
        shutil.rmtree(folder)
    tmp.rename(folder)
    _fsync(folder.parent)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_problem(folder: str | Path) -> str | None:
    """What is wrong with a checkpoint (a file missing, truncated or altered against its
    manifest), or None. One saved before checkpoints had a manifest is not checked."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        if not (folder / "state.json").exists():
            return "it has neither manifest.json nor state.json"
        logger.warning("checkpoint %s has no %s (saved by an older selfcest): loading it unchecked",
                       folder, MANIFEST)
        return None
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST} cannot be read ({type(error).__name__}: {error})"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return (f"{name} has {path.stat().st_size} bytes where {expected['bytes']} were "
                    "written (truncated?)")
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its SHA-256 (altered or damaged)"
    return None


def save_best(root: str | Path, state: TrainerState, model, value: float, rank: int = 0,
              world_size: int = 1, config: dict | None = None) -> Path:
    """Save new best weights (``trainer.keep_best``) as a weights-only checkpoint under
    ``root/best``, then record it in ``best.json`` and remove the best before it; every rank
    calls this. A crash in between leaves the earlier best recorded and whole."""
    best_root = Path(root) / BEST_DIR
    # keep: more than there are, so the new best stays whatever its step's place in the order.
    folder = save_checkpoint(best_root, state, model, None, None, rank=rank,
                             world_size=world_size, keep=len(list_checkpoints(best_root)) + 1,
                             config=config)
    if rank == 0:
        record = best_root / BEST_RECORD
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": state.step, "value": value,
                                   "checkpoint": folder.name}))
        tmp.replace(record)
        for old in list_checkpoints(best_root):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    return folder


def log_evaluation(root: str | Path, step: int, value: float) -> None:
    """Append one evaluation keep_best compared to ``root/best/evaluations.jsonl`` (step 0, a
    fresh run's first, starts the file anew)."""
    log = Path(root) / BEST_DIR / EVALUATIONS
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a" if step else "w") as file:
        file.write(json.dumps({"step": step, "value": value}) + "\n")


def read_evaluations(root: str | Path) -> list[dict]:
    """Every evaluation `log_evaluation` recorded under ``root``, in order."""
    log = Path(root) / BEST_DIR / EVALUATIONS
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def read_best(root: str | Path) -> dict | None:
    """The best a run saved (`save_best`): its ``step``, ``value`` and ``folder``; None when
    there is none."""
    record = Path(root) / BEST_DIR / BEST_RECORD
    if not record.exists():
        return None
    best = json.loads(record.read_text())
    folder = Path(root) / BEST_DIR / CHECKPOINT_DIR / best.pop("checkpoint")
    return {**best, "folder": folder} if folder.is_dir() else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    folder = Path(root) / CHECKPOINT_DIR
    if not folder.exists():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and _STEP_FOLDER.fullmatch(p.name))


RESUME_OFF = (False, None, "", "false", "False")  # values of trainer.resume that start fresh
RESUME_LATEST = (True, "true", "True", "latest")  # ... that continue the latest checkpoint


def resolve_resume(resume, output_dir: str | Path) -> Path | None:
    """``false`` → None; ``true`` → the latest sound checkpoint of output_dir (None if there
    is none yet, so a restarted job starts fresh); a path → that checkpoint (it must exist
    and be sound). Under ``true`` a damaged checkpoint is renamed ``step_N.damaged`` (kept
    for inspection, never resumed or counted again) and the one before it taken, with a
    warning; `CheckpointError` if every one is damaged."""
    if resume in RESUME_OFF:
        return None
    if resume in RESUME_LATEST:
        damaged = []
        for folder in reversed(list_checkpoints(output_dir)):
            problem = checkpoint_problem(folder)
            if problem is None:
                return folder
            logger.warning("checkpoint %s is damaged (%s): set aside as %s.damaged; trying the one "
                           "before it",
                           folder, problem, folder.name)
            folder.rename(folder.with_name(folder.name + ".damaged"))
            damaged.append(f"{folder.name}: {problem}")
        if damaged:
            raise CheckpointError(
                f"trainer.resume=true: every checkpoint under {Path(output_dir) / CHECKPOINT_DIR} "
                f"is damaged ({'; '.join(damaged)}); nothing sound to resume from (they are kept "
                "as *.damaged)")
        return None
    path = Path(str(resume))
    if not (path / "state.json").exists():
        raise FileNotFoundError(
            f"trainer.resume={resume!r}: no checkpoint there (expected {path}/state.json); "
            "use trainer.resume=true for the latest checkpoint of trainer.output_dir"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"trainer.resume={resume!r}: the checkpoint is damaged: {problem}")
    return path


def flat(data: dict, prefix: str = "") -> dict:
    """A nested dict as ``{"a.b": value}``."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict, now: dict,
                   unchecked: Iterable[str] = UNCHECKED_KEYS) -> dict[str, tuple]:
    """``{key: (saved value, current value)}`` for every key whose value differs between two
    run configs (JSON-ready nested dicts), leaving out ``unchecked`` keys and sections (a
    trailing dot) and keys ``saved`` lacks (settings added since it was written)."""
    before, after = flat(saved), flat(json.loads(json.dumps(now, default=str)))
    unchecked = tuple(unchecked)
    return {key: (before[key], after.get(key)) for key in sorted(before)
            if before[key] != after.get(key) and not _under(key, unchecked)}


def _under(key: str, keys: tuple[str, ...]) -> bool:
    """Whether ``key`` is one of ``keys`` or in a section of them (``log.`` or ``log``)."""
    return any(key == k or key.startswith(k if k.endswith(".") else k + ".") for k in keys)


def saved_config(folder: str | Path) -> dict | None:
    """The config a checkpoint was trained under: its own ``config.json``, or for one saved
    before checkpoints held it, its run folder's (written at the run's last start)."""
    folder = Path(folder)
    for path in (folder / CONFIG, folder.parent.parent / CONFIG):
        if path.exists():
            return json.loads(path.read_text())
    return None


def check_resume_config(folder: str | Path, config: dict,
                        allowed: Iterable[str]) -> dict[str, tuple]:
    """Refuse (`ConfigError`) to resume ``folder`` under a config that differs from its own
    in any key but the ``allowed`` ones (keys or sections, ``trainer.resume_changes``);
    return the allowed changes found, ``{key: (saved, now)}``."""
    saved = saved_config(folder)
    if saved is None:
        logger.warning("checkpoint %s holds no config: its settings cannot be compared with this "
                       "run's", folder)
        return {}
    changes = config_changes(saved, config)
    allowed = tuple(allowed)
    refused = {key: change for key, change in changes.items() if not _under(key, allowed)}
    if refused:
        listed = ", ".join(f"{key} ({_short(a)} -> {_short(b)})" for key, (a, b) in refused.items())
        keys = ",".join([*allowed, *refused])
        raise ConfigError(
            f"trainer.resume: this config differs from the one {Path(folder).name} was trained "
            "under in "
            f"{listed}; resume with that config, or allow the changes: "
            f"trainer.resume_changes=[{keys}]")
    return changes


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def load_checkpoint(folder: str | Path, model, optimizer=None, scheduler=None,
                    rank: int = 0) -> TrainerState:
    """Restore parameters and, given ``optimizer`` and ``scheduler`` (a resume), their states
    and this rank's RNG states; return the state. Without them only the weights are loaded.

    Every rank calls this; under several processes only rank 0 reads the weights and the
    optimizer state, and sends every process its part (its shard, under FSDP)."""
    folder = Path(folder)
    share = _distributed()
    weights, optimizer_state, problem = {}, {}, None
    if rank == 0 or not share:
        try:
            weights, optimizer_state = _read_checkpoint(folder, trainable_names(model),
                                                        optimizer is not None)
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
    if optimizer is not None:
        set_optimizer_state_dict(model, _torch_optimizer(optimizer), optimizer_state,
                                 options=options)
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        rng_file = folder / f"rng_rank{rank}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=True))
    data = json.loads((folder / "state.json").read_text())
    data.pop("world_size", None)
    return TrainerState(**data)


def _read_checkpoint(folder: Path, expected: set[str],
                     optimizer: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights and (with ``optimizer``) optimizer state of a checkpoint, the weights
    checked against the model's names."""
    weights = load_file(folder / "model.safetensors")
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(
            f"checkpoint {folder} does not match the model: missing {missing[:5]}, "
            f"unexpected {extra[:5]} (was it saved with another model or LoRA setting?)"
        )
    return weights, torch.load(folder / "optimizer.pt", weights_only=True) if optimizer else {}


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
    np.random.set_state((version, state["numpy_keys"].numpy().astype(np.uint32), position,
                         has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
