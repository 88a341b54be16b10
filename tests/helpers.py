"""Helpers shared by tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from selfcest.policy import ClonePolicy

DEMO_CONTEXT = {"L1": "1 2", "L2": "3 4"}


def overfit(policy: ClonePolicy, traces: list[tuple[list[int], list[tuple[str, list[int]]]]], steps: int = 150):
    """Train ``policy`` in place to reproduce ``traces`` (prompt ids, [(kind, ids), ...]);
    loss on ``sampled`` pieces only. A few seconds on a tiny model."""
    from selfcest.policy import sequence_logprobs

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
        logp = sequence_logprobs(policy.model, input_ids, attention)
        loss = -(logp * target_mask[:, 1:]).sum() / target_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.model.eval()
    return loss.item()
