"""The contract every generation backend implements: token ids in, token ids out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. Logprobs are always those of the distribution sampled from:
    ``log_softmax(logits / temperature)`` before top-p/top-k truncation (temperature 0 means
    greedy, and its logprobs are those of temperature 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    # Token ids never drawn: they are truncated away like top-k/top-p truncation (so the
    # logprobs stay those of the untruncated distribution). Banning the spawn-open token
    # is how a forced direct style is evaluated.
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Completion:
    """One generation call's result. ``token_ids`` include the stop token that ended it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]  # hit a stop token id / hit max_tokens
    weight_version: int


@runtime_checkable
class Backend(Protocol):
    """Generates continuations of token sequences.

    Concurrent `generate` calls are expected: a backend should batch requests that are
    pending at the same time. ``seed`` makes one request's sampling reproducible whatever
    else is batched with it. ``resume_token_ids`` are the stop tokens after which a later
    request continues this sequence (its prompt starts with this prompt and completion): a
    backend may keep the sequence's KV cache for it. ``weight_version`` increases every time
    new weights are served.
    """

    weight_version: int

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        stop_token_ids: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        resume_token_ids: Sequence[int] = (),
    ) -> Completion: ...

    def sync_weights(self, model) -> None:
        """Serve ``model``'s current weights from now on and increase ``weight_version``.

        Returns only once the new weights are really served; raises if they are not.
        """
        ...

    def sleep(self) -> None:
        """Free accelerator memory for a training phase (a no-op where nothing is held)."""
        ...

    def close(self) -> None:
        """Release the engine and its temporary files."""
        ...


def check_request(prompt_ids: Sequence[int], max_tokens: int) -> None:
    """Refuse a generation request no backend can serve: an empty prompt, or no tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not prompt_ids:
        raise ValueError("empty prompt")
