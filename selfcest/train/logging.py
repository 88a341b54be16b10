"""Run logging: a JSONL metrics file always; wandb and TensorBoard when asked; trees as JSONL.

Only the main process logs. Metric names are flat strings with "/" groups, e.g.
``reward/mean``, ``cost/critical_path_tokens``, ``gate/zero_variance_trees``, ``time/rollout``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from selfcest.rewards.base import reward_components
from selfcest.tree import CloneTree


def tree_metrics(tree: CloneTree) -> dict[str, float]:
    """What a step logs of one scored tree (averaged over trees): reward and accuracy, token
    costs, tree shape, spawn errors, truncation, and the reward's components and diagnostics."""
    costs = tree.costs()
    return {
        "reward/mean": tree.reward or 0.0,
        "accuracy": float(bool(tree.correct)),
        "cost/generated_tokens": costs.generated_tokens,
        "cost/root_generated_tokens": costs.root_generated_tokens,
        "cost/clone_generated_tokens": costs.clone_generated_tokens,
        "cost/critical_path_tokens": costs.critical_path_tokens,
        "cost/context_tokens": costs.context_tokens,
        "cost/processed_tokens": costs.processed_tokens,
        "cost/peak_context": costs.peak_context,
        "cost/discarded_tokens": costs.discarded_tokens,
        "tree/clones": costs.clones,
        "tree/depth": costs.depth,
        "tree/spawn_calls": sum(len(n.spawns) for n in tree.nodes.values()),
        "tree/spawn_errors": costs.spawn_errors,
        "tree/spawn_error_rate": costs.spawn_errors / max(1, costs.clones + costs.spawn_errors),
        "tree/truncated": float(any(n.finish_reason == "budget" for n in tree.nodes.values())),
        "tree/errors": float(tree.root.finish_reason == "error"),
        **reward_components(tree),
    }


class PhaseTimer:
    """Seconds spent in each phase of an update, summed over its micro-batches and logged as
    ``time/<phase>`` (forward, reference, backward, optimizer).

    On a GPU each phase ends with a synchronize: without it a phase would be charged with
    kernels that the one before it only launched.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.synchronize = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}": seconds for phase, seconds in self.seconds.items()}


class RunLogger:
    """Writes ``metrics.jsonl`` (one line per step) and, optionally, wandb/TensorBoard."""

    def __init__(
        self,
        output_dir: str | Path,
        config: dict[str, Any],
        wandb_mode: str = "disabled",
        wandb_project: str = "selfcest",
        run_name: str = "default",
        tensorboard: bool = False,
        resume_step: int | None = None,
    ) -> None:
        """``resume_step``: the step a resumed run starts after; its file keeps the rows up to
        that step (rows a stopped run logged after its checkpoint are trained again) and
        appends. None: a fresh run starts a new file."""
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        if resume_step is not None:
            _keep_rows_until(self.metrics_path, resume_step)
        self._file = self.metrics_path.open("a" if resume_step is not None else "w")
        (self.output_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb  # seconds to import: only runs that log to W&B pay for it

            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config,
                                     mode=wandb_mode, dir=str(self.output_dir), resume="allow")
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard

            self._tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._tensorboard is not None:
            for key, value in clean.items():
                self._tensorboard.add_scalar(key, value, step)

    def save_trees(self, step: int, trees: list[CloneTree], name: str = "trees") -> Path:
        folder = self.output_dir / name
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{step:06d}.jsonl"
        with path.open("w") as out:
            for tree in trees:
                out.write(tree.to_json() + "\n")
        return path

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _keep_rows_until(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) with its rows up to ``step``; a line cut short by a
    killed process, which no row can be read from, goes too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a ``metrics.jsonl`` file (the last row wins for a step logged twice)."""
    rows: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
