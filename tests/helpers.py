"""Helpers shared by tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from selfcest.modeling import forward_logprobs
from selfcest.policy import ClonePolicy

REPO = Path(__file__).resolve().parents[1]
DEMO_CONTEXT = {"L1": "1 2", "L2": "3 4"}


def overfit(policy: ClonePolicy, traces: list[tuple[list[int], list[tuple[str, list[int]]]]],
            steps: int = 150):
    """Train ``policy`` in place to reproduce ``traces`` (prompt ids, [(kind, ids), ...]);
    loss on ``sampled`` pieces only. A few seconds on a tiny model."""
    rows = []
    for prompt, pieces in traces:
        ids, mask = list(prompt), [0] * len(prompt)
        for kind, piece in pieces:
            ids += piece
            mask += [int(kind == "sampled")] * len(piece)
        rows.append((ids, mask))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    target_mask = torch.zeros_like(input_ids, dtype=torch.float)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
        target_mask[r, : len(mask)] = torch.tensor(mask, dtype=torch.float)
    optimizer = torch.optim.Adam(policy.model.parameters(), lr=1e-2)
    policy.model.train()
    for _ in range(steps):
        logp, _ = forward_logprobs(policy.model, input_ids, attention)
        loss = -(logp * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.model.eval()
    return loss.item()


def fill_missing(node, value: str) -> list[str]:
    """Set every mandatory (???) leaf of a composed config to ``value``; return their keys."""
    filled = []
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if OmegaConf.is_missing(node, key):
            node[key] = value
            filled.append(str(key))
        elif isinstance(node[key], (DictConfig, ListConfig)):
            filled += [f"{key}.{k}" for k in fill_missing(node[key], value)]
    return filled


def load_module(path: str, name: str):
    """The Python file ``path`` (relative to the repository) as a module called ``name``:
    scripts/ and benchmarks/ are not packages."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_main(name: str):
    """The ``main(argv)`` of ``scripts/<name>.py``, to run a script in process."""
    return load_module(f"scripts/{name}.py", f"script_{name}").main


# The pages whose every command block a test runs: the README and the user guide beside it.
USER_PAGES = ("README.md", "docs/architecture.md", "docs/training.md", "docs/paper_runs.md",
              "docs/development.md")


def readme_blocks(heading: str, language: str = "bash") -> list[str]:
    """The ``language`` blocks under a heading of the user pages (`USER_PAGES`, where each
    heading is on one page only), up to the next heading of any level."""
    pages = [text for page in USER_PAGES if f"\n{heading}\n" in (text := (REPO / page).read_text())]
    assert len(pages) == 1, f"{heading!r} is on {len(pages)} of the user pages, not one"
    section = re.split(r"\n#{2,3} ", pages[0].split(f"\n{heading}\n", 1)[1], maxsplit=1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


def commands(block: str) -> list[str]:
    """A block's commands, continuation lines joined; comment lines and trailing comments
    left out."""
    lines = block.replace("\\\n", " ").splitlines()
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in lines]
    return [line for line in lines if line and not line.startswith("#")]


def shell(command: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a README line in bash as a user of this environment would: this Python's folder
    (its console scripts: selfcest-train, ...) first on PATH, this checkout's selfcest imported.

    One OpenMP thread unless set, as in-process tests have (conftest.py): a tiny model's step
    takes 100x longer with threads that spin against other busy processes.
    """
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PATH": path, "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", "-c", command], check=False, cwd=cwd, env=env,
                          capture_output=True, text=True,
                          timeout=timeout)


# A 4-step run of the tiny model under a warmed-up cosine schedule (so a resume that lost the
# scheduler's state would train other weights), 2 prompts x 4 trees a step, a checkpoint
# every 2 steps; the reward of tests/train/faulty_reward.py, which can meet a fault on purpose.
# Trees of 24 tokens give every group's rewards some variance, so every step updates.
FAULTY_RUN = ["model=tiny", "trainer.steps=4", "trainer.save_every=2", "trainer.prompts_per_step=2",
              "trainer.trees_per_prompt=4", "trainer.lr=1e-2", "trainer.schedule=cosine",
              "trainer.warmup_steps=1",
              "rollout.budget.node_generation=24", "rollout.budget.tree_generation=64",
              "log.progress=false",
              "log.trees_every=0", f"task.reward={REPO / 'tests/train/faulty_reward.py'}:digits"]
REWARD_CALLS_PER_STEP = 8


def faulty_run(out: Path, *overrides: str, fault: str | None = None, at_step: int = 1, env: dict
               | None = None,
               timeout: int = 120, preexec_fn=None) -> subprocess.CompletedProcess:
    """``python -m selfcest.train`` of `FAULTY_RUN` into ``out``; with ``fault`` (see
    faulty_reward.py), met at the first reward call of step ``at_step``. A few seconds."""
    extra = ({"FAULT": fault, "FAULT_AT_CALL": str((at_step - 1) * REWARD_CALLS_PER_STEP + 1)}
             if fault else {})
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra,
                   **(env or {})}
    return subprocess.run([sys.executable, "-m", "selfcest.train", *FAULTY_RUN,
                           f"trainer.output_dir={out}",
                           *overrides], env=environment, capture_output=True, text=True,
                          timeout=timeout,
                          preexec_fn=preexec_fn)


def bound_by_file_permissions() -> None:
    """In a child process about to start (``preexec_fn``): as root, give up the capability
    to write where file permissions forbid it (CAP_DAC_OVERRIDE), so that a read-only folder
    is one for it too; nothing for other users, whom permissions bind already."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1  # <linux/prctl.h>, <linux/capability.h>


# What the tests of the README's training lines change: its placeholder model folder (for a
# `write_stand_in` model) and, after the line, one evaluated step of two prompts and two
# held-out tasks. The group size stays the configs' (the paper's 4 trees), so groups hold
# both rewards of the stand-in.
README_MODEL = "/path/to/model"
SMALL_RUN = ("trainer.steps=1", "trainer.eval_every=1", "trainer.prompts_per_step=2",
             "task.eval_size=2")


def write_stand_in(folder: Path, size: str = "tiny") -> None:
    """A tiny random Qwen2 (Hermes tool calls, as `model=hf` uses) that ends its turn at
    once when greedy, and writes a few "7" and newline tokens first when sampling.

    A random model writes garbage up to its budget (4096 tokens per node in these runs, minutes
    on a CPU). This one samples about 3 tokens, and the last line it writes is "7" in about a
    quarter of its outputs, so on tasks whose answer is 7 a group of 4 trees mostly holds both
    rewards; evaluation (greedy) ends at once. How: every input embedding gets one shared
    direction, which then dominates the residual stream, so the last hidden state points
    along it whatever the text; the output rows (tied to the embeddings) of three tokens get
    more of it, so those tokens take nearly all the probability: the end of turn most, then
    newline, then "7".
    """
    policy = ClonePolicy.build_tiny(seed=0, size=size, protocol="tool")
    embeddings = policy.model.get_input_embeddings().weight
    direction = torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    tokenizer = policy.tokenizer
    with torch.no_grad():
        embeddings += 2.0 * direction
        for token, weight in ((tokenizer.eos_token, 2.0), ("Ċ", 1.97), ("7", 1.95)):  # Ċ: newline
            embeddings[tokenizer.convert_tokens_to_ids(token)] += weight * direction
    policy.save_pretrained(folder)
