"""A reward for subprocess runs that meet a fault on purpose (``task.reward=<this file>:digits``).

It scores a tree by the share of digits in what it generated (varied under a random
policy, so every step trains). With ``FAULT`` and ``FAULT_AT_CALL`` in the environment, its
call number ``FAULT_AT_CALL`` (counted from 1 in this process) first does the fault: sends
this process SIGKILL, SIGTERM or SIGINT, (``FSIZE``) limits the size of any file it
writes from then on to ``FSIZE_BYTES``, as a disk that fills up would, or (``READONLY``)
makes the folder ``READONLY_DIR`` read-only.
"""

from __future__ import annotations

import os
import resource
import signal

from selfcest.rewards.base import RewardResult

calls = 0


def reward(tree, task) -> RewardResult:
    global calls
    calls += 1
    if calls == int(os.environ.get("FAULT_AT_CALL", 0)):
        fault = os.environ["FAULT"]
        if fault == "FSIZE":
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (int(os.environ["FSIZE_BYTES"]), resource.RLIM_INFINITY))
        elif fault == "READONLY":
            os.chmod(os.environ["READONLY_DIR"], 0o555)
        else:
            os.kill(os.getpid(), getattr(signal, fault))
    text = "".join(n.text() for n in tree.nodes.values())
    return RewardResult(score=sum(c.isdigit() for c in text) / max(1, len(text)), correct=False)


def digits(**params):
    """A factory, so the task group's reward_params (cost: null) have somewhere to go."""
    return reward
