"""Shared fixtures: one tiny policy per session (built in memory, never downloaded)."""

from __future__ import annotations

import pytest
import torch
from helpers import DEMO_CONTEXT, overfit

from selfcest.policy import ClonePolicy

# Tiny models gain nothing from intra-op threads, and OpenMP threads that spin against other
# busy processes slow them down tenfold; one thread keeps the suite fast and steady.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_policy() -> ClonePolicy:
    """A random tiny Qwen2 with the token protocol. Do not train it in place: tests share it."""
    return ClonePolicy.build_tiny(seed=0, size="tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_policy):
    return tiny_policy.tokenizer


@pytest.fixture(scope="session")
def spawning_policy(demo_task) -> ClonePolicy:
    """A tiny policy overfit to one delegation: split L1/L2 across two clones, add the results."""
    from selfcest.protocol import SpawnRequest

    policy = ClonePolicy.build_tiny(seed=1, size="tiny")
    p, enc = policy.protocol, policy.protocol.encode
    root = p.root_prompt(demo_task)
    traces = [
        (root, [("sampled", enc("<spawn>sum @L1<sep>sum @L2</spawn>")),
                ("return", enc("<return>3<sep>7</return>")),
                ("sampled", enc("Answer: 10<|im_end|>"))]),
        (p.clone_prompt(SpawnRequest("sum @L1", ("L1",)), DEMO_CONTEXT),
         [("sampled", enc("Answer: 3<|im_end|>"))]),
        (p.clone_prompt(SpawnRequest("sum @L2", ("L2",)), DEMO_CONTEXT),
         [("sampled", enc("Answer: 7<|im_end|>"))]),
    ]
    loss = overfit(policy, traces)
    assert loss < 0.05, f"the demo policy did not learn its traces (loss {loss:.3f})"
    return policy


@pytest.fixture(scope="session")
def demo_task():
    """The task `spawning_policy` learned to delegate."""
    from selfcest.task import Task

    return Task("demo", "Add all numbers in L1 L2.", "10", DEMO_CONTEXT)
