"""What a run's figures depend on besides its config: the CPU, the kernels, the library
versions, the threads and the code's commit.

Float results differ across CPUs (AVX2 and AVX-512 kernels, MKL's code paths), and a
long SFT run turns a difference of 1e-8 into another warm start, so every report names
the machine it came from (`describe`, rendered by `one_line`).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import torch


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found[1].strip() if found else platform.machine()


def _mkl_version() -> str | None:
    if not torch.backends.mkl.is_available():
        return None
    found = re.search(r"Math Kernel Library Version ([\w.\-]+)", torch.__config__.show())
    return found[1] if found else "unknown"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                          capture_output=True, text=True, timeout=10, check=True).stdout.strip()


def _commit() -> str | None:
    """The checkout's commit, with ``+changes`` when files differ from it; None outside git
    (an installed wheel)."""
    try:
        commit, changed = _git("rev-parse", "--short=12", "HEAD"), _git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if changed else "")


def describe() -> dict:
    """This process's machine, kernels, versions, threads and commit, as plain data."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
        "MKL_CBWR": os.environ.get("MKL_CBWR"),
        "torch": torch.__version__,
        "mkl": _mkl_version(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "commit": _commit(),
    }


def one_line(record: dict) -> str:
    """``describe``'s record as a sentence for a report."""
    forced = ", ".join(f"{key}={record[key]}" for key in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")
                       if record.get(key))
    return (f"{record['cpu']} ({record['cores']} cores), torch {record['torch']} "
            f"on {record['torch_cpu_capability']} kernels{f' ({forced})' if forced else ''}, "
            f"MKL {record['mkl'] or 'absent'}, {record['threads']} thread(s), "
            f"Python {record['python']}, commit {record['commit'] or 'unknown'}")
