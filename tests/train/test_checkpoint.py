"""Checkpoints: checked against their manifest on resume (a damaged one is set aside, never a
silent fresh start), refused under a changed config, and never half-written."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import bound_by_file_permissions, faulty_run
from test_trainer import small_config

from selfcest.configure import ConfigError, RunError
from selfcest.train.checkpoint import (
    CheckpointError,
    checkpoint_problem,
    list_checkpoints,
    resolve_resume,
)
from selfcest.train.config import validate
from selfcest.train.setup import build_trainer


def two_checkpoints(tmp_path, **trainer):
    """A 2-step run that saved after each step; its config."""
    config = small_config(tmp_path, steps=2, save_every=1, lr=1e-2, **trainer)
    run = build_trainer(config)
    run.train()
    run.close()
    return config


def damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbled":  # one byte flipped: the size is right, the content is not
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    else:
        path.unlink()


@pytest.mark.parametrize("name, how",
                         [("model.safetensors", "truncated"), ("optimizer.pt", "garbled"),
                          ("state.json", "missing")])
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_one_before_resumed(
    tmp_path, caplog, name, how):
    config = two_checkpoints(tmp_path)
    latest = tmp_path / "run/checkpoints/step_000002"
    damage(latest / name, how)
    config.trainer.resume = "true"
    with caplog.at_level("WARNING"):
        resumed = build_trainer(config)
    assert resumed.resumed_from.name == "step_000001"
    assert f"checkpoint {latest} is damaged ({name} " in caplog.text
    assert (latest.parent / "step_000002.damaged" / "manifest.json").exists()  # kept for inspection
    assert len(resumed.train()) == 1  # step 2 again
    resumed.close()
    assert checkpoint_problem(latest) is None and [c.name
                                                   for c in list_checkpoints(tmp_path / "run")] == [
        "step_000001", "step_000002"]


def test_a_run_whose_every_checkpoint_is_damaged_refuses_to_resume(tmp_path):
    """Never a silent start from scratch: the resume stops, naming every damage."""
    config = two_checkpoints(tmp_path)
    metrics = (tmp_path / "run/metrics.jsonl").read_text()
    for folder in list_checkpoints(tmp_path / "run"):
        damage(folder / "model.safetensors", "garbled")
    config.trainer.resume = "true"
    damaged = (r"every checkpoint under .* is damaged \(step_000002: model.safetensors does not "
               r"match its SHA-256.*step_000001: .*nothing sound to resume")
    with pytest.raises(CheckpointError, match=damaged):
        build_trainer(config)
    assert (tmp_path / "run/metrics.jsonl").read_text() == metrics
    config.trainer.resume = str(tmp_path / "run/checkpoints/step_000002.damaged")
    with pytest.raises(CheckpointError,
                       match="the checkpoint is damaged: model.safetensors does not match"):
        build_trainer(config)


def test_a_checkpoint_from_before_manifests_still_loads_unchecked(tmp_path, caplog):
    two_checkpoints(tmp_path)
    latest = tmp_path / "run/checkpoints/step_000002"
    for name in ("manifest.json", "config.json"):
        (latest / name).unlink()
    with caplog.at_level("WARNING"):
        assert resolve_resume("true", tmp_path / "run") == latest
    assert "has no manifest.json (saved by an older selfcest): loading it unchecked" in caplog.text


def test_a_resume_under_a_changed_config_is_refused_naming_each_key(tmp_path):
    config = two_checkpoints(tmp_path)
    config.trainer.resume, config.trainer.steps, config.rollout.temperature = "true", 3, 0.5
    config.trainer.keep_checkpoints = 3  # checkpoint cadence may change
    with pytest.raises(ConfigError) as refused:
        build_trainer(config)
    assert str(refused.value) == (
        "trainer.resume: this config differs from the one step_000002 was trained under in "
        "rollout.temperature (1.0 -> 0.5), trainer.steps (2 -> 3); resume with that config, or "
        "allow the changes: trainer.resume_changes=[rollout.temperature,trainer.steps]")
    config.trainer.resume_changes = ["trainer.steps"]
    with pytest.raises(ConfigError, match=r"in rollout.temperature \(1.0 -> 0.5\);"):
        build_trainer(config)
    config.trainer.resume_changes = ["trainer.steps", "rollout"]  # a section allows every key in it
    resumed = build_trainer(config)
    assert len(resumed.train()) == 1
    resumed.close()


def test_resume_changes_must_name_keys_of_the_config(tmp_path):
    config = small_config(tmp_path)
    config.trainer.resume_changes = ["trainer.stpes"]
    with pytest.raises(ConfigError, match="trainer.resume_changes names 'trainer.stpes', which is "
                                          "neither a key"):
        validate(config)
    config.trainer.resume_changes = ["rollout.budget", "trainer.steps"]
    validate(config)


def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_one_before(tmp_path):
    """The disk fills up in step 3 (no file may grow past 128 KiB from then on; the weights
    take 0.5 MB): the step-4 save fails, the run stops naming the cause, and the step-2
    checkpoint is whole and resumable; nothing half-written is left."""
    out = tmp_path / "run"
    full = faulty_run(out, fault="FSIZE", at_step=3, env={"FSIZE_BYTES": str(128 * 1024)})
    assert full.returncode == 1, full.stderr[-2000:]
    message = full.stderr.strip().splitlines()[-1]
    assert message.startswith("selfcest: stopped: could not write checkpoint "
                              f"{out}/checkpoints/step_000004: ")
    assert "File too large" in message
    assert message.endswith(f"; the previous checkpoint {out}/checkpoints/step_000002 is intact")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]
    # What trainer.resume=true continues from (test_lifecycle.py resumes such a run for real).
    assert resolve_resume("true", out) == out / "checkpoints/step_000002"


def test_an_unwritable_checkpoint_folder_stops_the_run_and_keeps_the_one_before(tmp_path):
    """The checkpoints folder turns read-only in step 3: the step-4 save cannot even start its
    folder, the run stops naming it and the cause, and the step-2 checkpoint is whole. (Root
    writes into read-only folders: as root the run gives that power up, helpers.py.)"""
    out = tmp_path / "run"
    folder = out / "checkpoints"
    try:
        stopped = faulty_run(out, fault="READONLY", at_step=3, env={"READONLY_DIR": str(folder)},
                             preexec_fn=bound_by_file_permissions)
    finally:
        if folder.exists():
            folder.chmod(0o755)
    assert stopped.returncode == 1, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"selfcest: stopped: could not create {folder}/step_000004.tmp: PermissionError: [Errno "
        "13] Permission "
        f"denied: '{folder}/step_000004.tmp'; the previous checkpoint {folder}/step_000002 is "
        "intact")
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002"]
    assert checkpoint_problem(folder / "step_000002") is None


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    config = two_checkpoints(tmp_path)
    config.trainer.resume = "true"
    run = build_trainer(config)
    with torch.no_grad():
        next(run.policy.model.parameters())[0] = float("nan")
    run.state.step = 3
    with pytest.raises(RunError, match=r"not saving step 3: parameters are not finite "
                                       r"\(model.embed_tokens.weight\)"):
        run.save()
    run.close()
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["step_000001", "step_000002"]
    assert json.loads(
        (tmp_path / "run/checkpoints/step_000002/state.json").read_text())["step"] == 2
