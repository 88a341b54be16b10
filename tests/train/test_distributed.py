"""Two real processes (torchrun, gloo on CPU): gradients are synchronised, so parameters stay
identical across ranks, and prompts are split between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_trainer import DIGIT_REWARD

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.mark.distributed
def test_two_process_ddp_keeps_ranks_identical(tmp_path):
    reward = tmp_path / "digit_reward.py"
    reward.write_text(DIGIT_REWARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
         str(WORKER), str(tmp_path), f"{reward}:reward"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]  # both processes saw each other
    assert ranks[0]["before"] == ranks[1]["before"]
    assert ranks[0]["after"] != ranks[0]["before"]  # they trained
    assert ranks[0]["after"] == ranks[1]["after"]  # on synchronised gradients
