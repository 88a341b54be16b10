"""The main job (``make run``): the CPU reproduction and the controller's main sweep, side by side.

::

    python -m selfcest.experiments.main

Both are single-threaded (``trainer.cpu_threads: 1``), so on a 2-core machine each gets a
core: `selfcest.experiments.cpu_repro` (``runs/cpu_repro/report.md``) and
`selfcest.experiments.controller_sweep` over ``configs/controller_main.yaml``
(``runs/controller_main/summary.md``). Each one's output goes to its log beside its
report, and every line is echoed here with the job's name in front. Run either command on
its own to pass overrides.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from selfcest import machine

JOBS = {
    "cpu_repro": (["-m", "selfcest.experiments.cpu_repro"], Path("runs/cpu_repro")),
    "controller": (["-m", "selfcest.experiments.controller_sweep", "--config-name",
                    "controller_main"],
                   Path("runs/controller_main")),
}


def _echo(name: str, process: subprocess.Popen, log: Path) -> None:
    with open(log, "w") as file:
        for line in process.stdout:
            file.write(line)
            file.flush()
            print(f"[{name}] {line}", end="", flush=True)


def main() -> int:
    """Start every job, echo their output, wait; the exit code is the first failure's (0)."""
    start = time.perf_counter()
    print(f"machine: {machine.one_line(machine.describe())}", flush=True)
    running = []
    for name, (args, folder) in JOBS.items():
        folder.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        echo = threading.Thread(target=_echo, args=(name, process, folder / f"{name}.log"),
                                daemon=True)
        echo.start()
        running.append((name, process, echo, folder))
    codes = []
    for name, process, echo, folder in running:
        codes.append(process.wait())
        echo.join()
        print(f"{name}: exit {codes[-1]}; output in {folder}", flush=True)
    print(f"main job done in {time.perf_counter() - start:.0f}s: runs/cpu_repro/report.md, "
          "runs/controller_main/summary.md", flush=True)
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
