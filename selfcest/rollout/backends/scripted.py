"""A backend that answers from a script: for testing the engine's logic, not for training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from selfcest.rollout.backends.base import Completion, SamplingParams


@dataclass
class ScriptedCall:
    """One request the backend received, and what it answered."""

    prompt_ids: list[int]
    max_tokens: int
    completion: Completion


class ScriptedBackend:
    """Answers each request with ``respond(prompt_text)``, encoded with ``tokenizer``.

    A script that does not end its text with a stop token gets the tokenizer's EOS appended
    (as a model ending its turn). The result is cut exactly as a real backend would: after
    the first stop token, or at ``max_tokens``. If ``respond`` raises, the request fails with
    that exception. Logprobs are a fixed ``logprob`` per token. Every call is recorded in ``calls``.
    """

    def __init__(self, tokenizer, respond: Callable[[str], str], logprob: float = -0.5):
        self.tokenizer = tokenizer
        self.respond = respond
        self.logprob = logprob
        self.weight_version = 0
        self.calls: list[ScriptedCall] = []

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        stop_token_ids: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        resume_token_ids: Sequence[int] = (),
    ) -> Completion:
        text = self.respond(self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not any(token in stop_token_ids for token in ids):
            ids.append(self.tokenizer.eos_token_id)
        finish = "length"
        for i, token in enumerate(ids[:max_tokens]):
            if token in stop_token_ids:
                ids, finish = ids[: i + 1], "stop"
                break
        else:
            ids = ids[:max_tokens]
        completion = Completion(ids, [self.logprob] * len(ids), finish, self.weight_version)
        self.calls.append(ScriptedCall(list(prompt_ids), max_tokens, completion))
        return completion

    def sync_weights(self, model) -> None:
        self.weight_version += 1

    def sleep(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to release."""
