"""What a run does about the process it lives in: one run per output folder, and a clean
stop on SIGTERM or SIGINT.

`RunLock`: ``<output_dir>/run.lock`` holds the owner's pid and host under an exclusive
``flock`` kept for the run's life. A second run on the folder is refused, naming the owner;
the kernel drops the lock of a process that dies however it dies (SIGKILL included), and the
next run takes the folder over with a warning naming the dead pid.

`StopSignals`: while a run trains, SIGTERM and SIGINT only set a flag, which the trainer
reads after each step: it saves a checkpoint there and returns, and ``selfcest-train`` exits
0 (SIGTERM) or 130 (SIGINT). A second SIGINT stops at once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import threading
import weakref
from pathlib import Path

from selfcest.configure import RunError

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunLock:
    """The lock of one output folder (see the module doc); `release` it, or it goes with
    the process."""

    def __init__(self, path: Path, descriptor: int) -> None:
        self.path = path
        self._descriptor = descriptor
        self._finalizer = weakref.finalize(self, _release, path, descriptor)

    @classmethod
    def acquire(cls, output_dir: str | Path) -> RunLock:
        """Take ``output_dir``'s lock, or raise `RunError` naming the run that holds it."""
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_FILE
        while True:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                raise RunError(_held_message(folder, _owner(path), certain=True)) from None
            # The holder may have released (and removed) the file between our open and our
            # lock: then we hold a lock on a file nobody else will open again.
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                break
            os.close(descriptor)
        previous = _owner(path)
        # flock does nothing on some network filesystems
        if previous and _alive_elsewhere(previous):
            os.close(descriptor)
            raise RunError(_held_message(folder, previous, certain=False))
        if previous:
            logger.warning("%s: taking over the lock of pid %s on %s, which is no longer running "
                           "(it stopped without releasing it)", folder, previous.get("pid"),
                           previous.get("host"))
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, me, 0)
        os.fsync(descriptor)
        return cls(path, descriptor)

    def release(self) -> None:
        self._finalizer()


def _release(path: Path, descriptor: int) -> None:
    path.unlink(missing_ok=True)  # before unlocking: no run may lock a file about to go
    os.close(descriptor)


def _owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _alive_elsewhere(owner: dict) -> bool:
    """Whether the recorded owner is another process that is still running (a pid on another
    host cannot be checked: it counts as running)."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _held_message(folder: Path, owner: dict, certain: bool) -> str:
    """Why a run is refused; ``certain``: the lock is held (else its owner only seems alive:
    another host's pid, or a lock on a filesystem without flock)."""
    who = "this process" if owner.get("pid") == os.getpid() else "another run"
    fix = "close() the trainer that holds it" if who == "this process" else "wait for it to finish"
    if not certain:
        fix += f", or remove {folder / LOCK_FILE} if you know that no run uses the folder"
    return (f"trainer.output_dir={folder} is in use by {who} (pid {owner.get('pid', '?')} on "
            f"{owner.get('host', '?')}); {fix}, or choose another trainer.output_dir")


class StopSignals:
    """``with StopSignals() as stop:`` SIGTERM and SIGINT set ``stop.received`` (the signal's
    name) instead of stopping the process; outside the main thread, where Python cannot
    install handlers, it does nothing. A second SIGINT raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle)
                              for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        self.received = signal.Signals(number).name
        logger.warning("%s received: stopping after this step with a checkpoint%s", self.received,
                       " (SIGINT again stops at once)" if number == signal.SIGINT else "")
        if number == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
