"""Helpers shared by tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from selfcest.policy import ClonePolicy, forward_logprobs

DEMO_CONTEXT = {"L1": "1 2", "L2": "3 4"}


def overfit(policy: ClonePolicy, traces: list[tuple[list[int], list[tuple[str, list[int]]]]], steps: int = 150):
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


def script_main(name: str):
    """The ``main(argv)`` of ``scripts/<name>.py``, to run a script in process."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main
