"""A Python module run as a worker process that answers JSON lines, each within a time limit.

Why a process: a thread cannot be stopped, so code that may run for hours (math-verify on
``9^9^9^9``, a user's reward caught in a loop) is cut off only by killing the process it
runs in. `LineWorker` starts ``python -m <module> <args>`` on the first request; the
module prints ``{"ready": true}`` once set up (or ``{"ready": false, "error": ...}``), then
answers each request line with one line. A request that takes longer than its timeout, or
a worker that dies, kills the process (`WorkerTimeout`, `WorkerLost`); the next request
starts a fresh one (about a second or two of imports, not counted in any timeout).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any


class WorkerTimeout(Exception):
    """The request took longer than its timeout; the worker was killed."""


class WorkerLost(Exception):
    """The worker died or closed its output before answering."""


class WorkerStartError(RuntimeError):
    """The worker could not set up (an import failed, say): no request can be answered."""


class LineWorker:
    """One worker process (see the module doc). Thread-safe: one request at a time,
    concurrent callers wait. ``stderr``: where the worker's stderr goes (None: this
    process's). Closed at exit."""

    def __init__(self, module: str, args: tuple[str, ...] = (), startup_timeout_s: float = 120.0,
                 stderr: int | None = subprocess.DEVNULL) -> None:
        self.module, self.args, self.stderr = module, tuple(args), stderr
        self.startup_timeout_s = startup_timeout_s  # seconds the worker may take to set up
        self.restarts = 0  # workers killed after a timeout or a crash
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        weakref.finalize(self, _kill, self.__dict__)

    def ask(self, request: dict, timeout_s: float | None) -> dict:
        """The worker's answer to ``request``; `WorkerTimeout` past ``timeout_s`` seconds
        (None: no limit), `WorkerLost` if it died."""
        with self._lock:
            self._start()
            try:
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                self._restart()
                raise WorkerTimeout(f"no answer within {timeout_s:g} s") from None
            except OSError as error:  # the worker died between requests
                self._restart()
                raise WorkerLost(str(error)) from None
            if line is None:
                self._restart()
                raise WorkerLost("the worker exited")
        return json.loads(line)

    def close(self) -> None:
        with self._lock:
            _kill(self.__dict__)

    def _start(self) -> None:
        if self._process is not None:
            return
        # The package root goes on the worker's path so `-m` finds selfcest when it is used
        # from a source checkout without being installed.
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self._process = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1,
            env=env)
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(self._process.stdout, self._lines),
                         daemon=True).start()
        try:
            ready = self._lines.get(timeout=self.startup_timeout_s)
        except queue.Empty:
            ready = None
        status = json.loads(ready) if ready else {"ready": False, "error": "no answer"}
        if not status.get("ready"):
            _kill(self.__dict__)
            raise WorkerStartError(f"the {self.module} worker did not start: {status.get('error')}")

    def _restart(self) -> None:
        _kill(self.__dict__)
        self.restarts += 1


def _pump(stream, lines: queue.Queue) -> None:
    """Forward the worker's stdout lines into a queue; None marks its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _kill(state: dict[str, Any]) -> None:
    """Stop a worker (takes the instance __dict__ so weakref.finalize can call it)."""
    process = state.get("_process")
    if process is None:
        return
    state["_process"] = None
    process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()
        except OSError:
            pass


def serve(answer, setup=None) -> None:
    """The worker's side: run ``setup()`` (an error in it is reported as not ready), say
    ready, then write ``answer(request)`` for each request line until stdin closes. An
    exception in ``answer`` is sent back as ``{"failed": "<type>: <message>"}``: one bad
    request must not take the worker down."""
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers may reach the parent's pipe
    try:
        if setup is not None:
            setup()
    except Exception as error:
        out.write(json.dumps({"ready": False, "error": f"{type(error).__name__}: {error}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            response = answer(json.loads(line))
        except Exception as error:
            response = {"failed": f"{type(error).__name__}: {error}"[:500]}
        out.write(json.dumps(response, default=repr) + "\n")
        out.flush()
