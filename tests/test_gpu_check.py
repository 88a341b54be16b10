"""scripts/gpu_check.sh: the one-shot GPU check runs, where a lent GPU machine has only torch,
transformers, accelerate and peft (CI runs the full --cpu check: .ci/run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

# What the lent machine lacks of selfcest's requirements (torch brings jinja2 and sympy).
ABSENT = ("hydra", "omegaconf", "vllm", "datasets", "matplotlib", "wandb", "math_verify",
          "reasoning_gym",
          "pyarrow", "tensorboard", "antlr4", "latex2sympy2_extended")
# Every module path finder comes back empty for them, as on a machine without them.
HIDE = f"""
import importlib.machinery
_find = importlib.machinery.PathFinder.find_spec.__func__
def _hidden(cls, name, path=None, target=None):
    return None if name.split(".")[0] in {set(ABSENT)!r} else _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
"""


def test_the_check_imports_nothing_the_bare_machine_lacks(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-c",
                           "import runpy; runpy.run_path('scripts/gpu_check.py'); "
                           "import sys; print(sorted(set(m.split('.')[0] for m in sys.modules) & "
                           f"{set(ABSENT)!r}))"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.gpu
def test_the_check_runs_on_a_gpu(tmp_path):
    """The check itself, on one NVIDIA GPU (the machine's run writes its figures to
    docs/performance.md)."""
    if not __import__("torch").cuda.is_available():
        pytest.skip("no CUDA device")
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--out", str(out)], cwd=REPO,
                          capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {row["shape"] for row in report["train"]} == {"0.5b", "1.5b"} and report["seconds"] < 480
