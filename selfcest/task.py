"""The task record every generator and loader produces (`selfcest.tasks` has the sources)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One question for the root agent.

    ``context`` maps keys to texts that the root does not see; a parent hands a key to a
    clone (``@KEY`` in the token protocol, ``shared_context`` in the tool protocol) and the
    engine expands it into that clone's prompt only.
    """

    id: str
    prompt: str  # what the root reads (for context tasks: the question and the keys)
    answer: str  # the reference answer, as text
    context: dict[str, str] = field(default_factory=dict)
    source: str = ""  # dataset or generator name, for per-source metrics and reward routing
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt": self.prompt,
            "answer": self.answer,
            "context": dict(self.context),
            "source": self.source,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        return cls(**data)


def context_block(keys: Sequence[str], context: Mapping[str, str]) -> str:
    """The context texts of ``keys``, one ``[key] text`` line each: how a clone reads the
    context its parent handed it, and how a prompt prints context inline."""
    return "\n".join(f"[{key}] {context[key]}" for key in keys)
