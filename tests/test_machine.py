"""The machine record every report carries (selfcest/machine.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from selfcest import machine


def test_the_record_names_the_kernels_threads_and_commit_a_process_really_ran_with():
    """Read in a child process given other kernels and one thread, so the record is not just
    this process's defaults."""
    code = ("import json, torch; torch.set_num_threads(1); "
            "from selfcest import machine; print(json.dumps(machine.describe()))")
    env = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
           "PATH": os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    record = json.loads(out)
    assert record["torch_cpu_capability"] == "DEFAULT"
    assert (record["ATEN_CPU_CAPABILITY"], record["MKL_CBWR"], record["threads"]) == (
        "default", "COMPATIBLE", 1)
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, cwd=Path(machine.__file__).parent).stdout.strip()
    assert (record["commit"] or "").split("+")[0] == head  # both empty outside a checkout
    line = machine.one_line(record)
    assert "DEFAULT kernels (ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE)" in line
    assert "1 thread(s)" in line and record["cpu"] in line
