"""A run and its process: one run per output folder, SIGTERM and SIGINT stop it with a
checkpoint, and a run killed outright resumes to exactly what an uninterrupted one trains."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from helpers import REPO, faulty_run

from selfcest.configure import RunError
from selfcest.train.checkpoint import list_checkpoints
from selfcest.train.lifecycle import LOCK_FILE, RunLock, StopSignals
from selfcest.train.logging import read_metrics


def same(a, b) -> bool:
    """Tensors bitwise, containers item by item (a loaded state dict holds tuples as lists)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return a == b


def trained(out) -> dict:
    """What a finished run leaves: its last checkpoint's weights, optimizer, scheduler and
    state, and every metrics row (timings aside), as the file holds them."""
    (last,) = list_checkpoints(out)[-1:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "checkpoint": last.name,
        "weights": (last / "model.safetensors").read_bytes(),
        "optimizer": torch.load(last / "optimizer.pt", weights_only=True),
        "scheduler": torch.load(last / "scheduler.pt", weights_only=True),
        "state": json.loads((last / "state.json").read_text()),
        "metrics": [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}
                    for row in rows],
    }


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run of tests/helpers.FAULTY_RUN."""
    out = tmp_path_factory.mktemp("straight") / "run"
    done = faulty_run(out)
    assert done.returncode == 0, done.stderr[-2000:]
    return trained(out)


def test_a_run_killed_mid_step_resumes_to_bitwise_the_same_weights_optimizer_and_metrics(
    straight, tmp_path):
    """SIGKILL in step 4, after the step-2 checkpoint and step 3's metrics row: the resumed
    run takes the dead run's lock over, drops that row, trains steps 3 and 4 again, and ends
    where the uninterrupted run did (the LR of every step included: a cosine schedule)."""
    out = tmp_path / "run"
    killed = faulty_run(out, fault="SIGKILL", at_step=4)
    assert killed.returncode == -signal.SIGKILL
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert [c.name for c in list_checkpoints(out)] == ["step_000002"]
    dead = json.loads((out / LOCK_FILE).read_text())["pid"]  # the killed run's own record
    resumed = faulty_run(out, "trainer.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (f"taking over the lock of pid {dead} on {socket.gethostname()}, which is no longer "
            "running") in resumed.stdout
    again = trained(out)
    assert len({row["lr"] for row in again["metrics"]}) == 4
    assert all(row["train/optimizer_steps"] == 1 for row in again["metrics"])
    for key in straight:
        assert same(again[key], straight[key]), key


@pytest.mark.parametrize("name, code", [("SIGTERM", 0), ("SIGINT", 130)])
def test_a_stop_signal_saves_at_the_end_of_the_step_and_the_run_continues(
    straight, tmp_path, name, code):
    """The signal arrives during step 3's scoring: step 3 finishes, is saved and logged, the
    process says so and exits 0 (SIGTERM) or 130 (SIGINT); resumed (after SIGTERM), the run
    ends where the uninterrupted one did."""
    out = tmp_path / "run"
    stopped = faulty_run(out, fault=name, at_step=3)
    assert stopped.returncode == code, stopped.stderr[-2000:]
    # Hydra's log
    assert f"{name} received: stopping after this step with a checkpoint" in stopped.stdout
    assert (f"selfcest: stopped by {name} after step 3 of 4; checkpoint "
            f"{out}/checkpoints/step_000003") in stopped.stderr
    assert [c.name for c in list_checkpoints(out)] == ["step_000002", "step_000003"]
    assert not (out / LOCK_FILE).exists()  # released on the way out
    if name == "SIGINT":
        return  # the same checkpoint as SIGTERM's: one resume shows it continues
    resumed = faulty_run(out, "trainer.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = trained(out)
    for key in straight:
        assert same(again[key], straight[key]), key


def test_a_second_run_on_a_folder_in_use_is_refused_and_changes_nothing(tmp_path):
    """A live process holds the folder's lock: a run started on it exits 1 naming that pid,
    before any compute, and changes no file there (Hydra adds its record of the start in a
    folder of its own, configs/train.yaml)."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from selfcest.train.lifecycle import RunLock; "
         f"lock = RunLock.acquire({str(out)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline() == "held\n"
        (out / "metrics.jsonl").write_text('{"step": 1}\n')  # as if the holder had trained a step
        before = files(out)
        refused = faulty_run(out)
        assert refused.returncode == 1
        assert refused.stderr.strip().splitlines()[-1] == (
            f"selfcest: stopped: trainer.output_dir={out} is in use by another run (pid "
            f"{holder.pid} on {socket.gethostname()}); wait for it to finish, or choose another "
            "trainer.output_dir")
        after = files(out)
        assert {name: after[name] for name in before} == before
        assert all(name.startswith(".hydra/") or name == "configure.log" for name in after.keys()
                   - before.keys())
    finally:
        holder.kill()
        holder.wait()


def files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_the_lock_is_exclusive_within_a_process_and_released(tmp_path):
    lock = RunLock.acquire(tmp_path)
    with pytest.raises(RunError,
                       match=r"in use by this process .*close\(\) the trainer that holds it"):
        RunLock.acquire(tmp_path)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    RunLock.acquire(tmp_path).release()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": int(dead.stdout),
                                                  "host": socket.gethostname()}))
    with caplog.at_level("WARNING"):
        lock = RunLock.acquire(tmp_path)
    assert f"taking over the lock of pid {int(dead.stdout)}" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_recorded_by_a_live_process_is_refused_even_where_flock_is_not_shared(tmp_path):
    """On a filesystem whose flock does not reach other clients, the recorded owner decides."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(),
                                                  "host": socket.gethostname()}))
    with pytest.raises(RunError,
                       match=f"pid {os.getppid()} .*or remove {tmp_path / LOCK_FILE} if you know"):
        RunLock.acquire(tmp_path)


def test_stop_signals_only_set_a_flag_and_restore_the_handlers():
    def outer(number, frame):  # stands in for the default action, which would end pytest
        reached.append(number)

    reached = []
    previous = signal.signal(signal.SIGTERM, outer)
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM" and not reached
        assert signal.getsignal(signal.SIGTERM) is outer
    finally:
        signal.signal(signal.SIGTERM, previous)
