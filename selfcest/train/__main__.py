"""``python -m selfcest.train``: the same as ``selfcest-train``."""

from selfcest.cli import train

train()
