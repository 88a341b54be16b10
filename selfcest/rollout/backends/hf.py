"""HFBackend: generation with a transformers causal LM, batched across concurrent requests.

Requests that are pending at the same time (the branches of every tree in the batch that
wait for tokens) are decoded together: one left-padded prefill, then one forward pass per
step for all of them. Each row stops on its own stop tokens or its own ``max_tokens``, and
finished rows leave the batch (and the KV cache) at once, so short branches cost nothing
while long ones finish. Each row samples with its own seeded generator, so a request's tokens
do not depend on what else was batched with it (up to floating-point effects of padding).

Requests with the same prompt in one batch (a GRPO group) are prefilled once; a node resumed
after its spawn call prefills only what came after its cached prefix (`PrefixCache`).

Simplification: requests that arrive while a batch decodes wait for the next one (vLLM is
the engine for continuous batching); at these tree sizes the engine's waves keep batches full.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from selfcest.modeling import cache_argument, plain_attention_cache, repeated_rows
from selfcest.rollout.backends.base import Completion, SamplingParams, check_request
from selfcest.rollout.backends.kv_cache import reserved_cache
from selfcest.rollout.backends.prefix_cache import PrefixCache

# Positions a decode's KV buffers hold past its prompts at first (kv_cache.py): a decode that
# goes further doubles them (copies amortised over the steps), and a large max_tokens does not
# reserve memory that rows stopping early never use.
RESERVED_AHEAD = 256


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int]
    sampling: SamplingParams
    seed: int
    resume_token_ids: frozenset[int]
    future: asyncio.Future


class HFBackend:
    """Token-in/token-out generation with a (possibly training) transformers model.

    The backend reads the model object it was given, so after an optimizer step on that
    same object `sync_weights` only has to bump the version.
    """

    def __init__(self, model, pad_token_id: int, max_batch_size: int = 64,
                 prefix_cache_mb: float = 512) -> None:
        """``prefix_cache_mb``: memory for the keys and values of rows that stopped, until
        the request that resumes them (0 turns the prefix cache off)."""
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        # Plain attention caches decode into reserved room (kv_cache.py) and can take prefixes.
        self.plain_cache = plain_attention_cache(model)
        self.prefix_cache = (PrefixCache(int(prefix_cache_mb * 2**20))
                             if prefix_cache_mb > 0 and self.plain_cache else None)
        self._pending: list[_Request] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        # Counters for benchmarks and logs: passes, batches, prompt positions prefilled (with
        # and without padding), prompt positions taken from the prefix cache instead, those of
        # rows that repeated another row of their batch, and the seconds of the prefill passes.
        self.forward_passes = 0
        self.batches = 0
        self.prefill_tokens = 0
        self.prefill_real_tokens = 0
        self.cached_prompt_tokens = 0
        self.repeated_prompt_tokens = 0
        self.prefill_seconds = 0.0

    # ------------------------------------------------------------------ async front

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
        check_request(prompt_ids, max_tokens)
        loop = asyncio.get_running_loop()
        self._ensure_worker(loop)
        request = _Request(list(prompt_ids), max_tokens, frozenset(stop_token_ids), sampling,
                           seed, frozenset(resume_token_ids), loop.create_future())
        self._pending.append(request)
        self._wakeup.set()
        return await request.future

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop or self._worker is None or self._worker.done():
            self._loop = loop
            self._pending = []
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            # Let every coroutine that is ready run up to its own request first, so that all
            # branches waiting at this moment share the batch (deterministic: asyncio runs
            # ready callbacks in FIFO order).
            seen = -1
            while seen != len(self._pending):
                seen = len(self._pending)
                await asyncio.sleep(0)
            batch, self._pending = self._pending[
                : self.max_batch_size], self._pending[self.max_batch_size :]
            if not self._pending:
                self._wakeup.clear()
            live = [r for r in batch if not r.future.cancelled()]
            if not live:
                continue
            try:
                completions = self.generate_batch(live)
            except Exception as error:  # fail these requests, keep serving others
                for request in live:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            for request, completion in zip(live, completions):
                if not request.future.done():
                    request.future.set_result(completion)

    # ------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def generate_batch(self, requests: Sequence[_Request]) -> list[Completion]:
        """Decode several requests together; one forward pass per step for all live rows."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            return self._decode(requests)
        finally:
            model.train(was_training)

    def _decode(self, requests: Sequence[_Request]) -> list[Completion]:
        model = self.model
        device = next(model.parameters()).device
        input_ids, attention, positions, cache = self._prefill_inputs(requests, device)
        generators = [torch.Generator().manual_seed(r.seed) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[str] = ["length"] * len(requests)
        live = list(range(len(requests)))  # request index of each batch row
        cache_arg = cache_argument(model)
        self.batches += 1
        prefill_start = time.perf_counter()
        while True:
            if prefill_start is not None:
                logits = self._first_pass(input_ids, attention, positions, cache, cache_arg)
                self.prefill_seconds += time.perf_counter() - prefill_start
                prefill_start = None
            else:
                out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            use_cache=True, logits_to_keep=1, **{cache_arg: cache})
                logits = out.logits[:, -1, :].float()
            self.forward_passes += 1
            drawn, drawn_logprobs = sample_rows(
                logits, [requests[i].sampling for i in live], [generators[i] for i in live]
            )
            keep_rows = []
            next_tokens = []
            for row, index in enumerate(live):
                token = drawn[row]
                tokens[index].append(token)
                logprobs[index].append(drawn_logprobs[row])
                if token in requests[index].stop_token_ids:
                    finish[index] = "stop"
                    if token in requests[index].resume_token_ids:
                        self._keep_prefix(cache, row, requests[index].prompt_ids
                                          + tokens[index][:-1])
                elif len(tokens[index]) < requests[index].max_tokens:
                    keep_rows.append(row)
                    next_tokens.append(token)
            if not keep_rows:
                break
            if len(keep_rows) < len(live):
                keep = torch.tensor(keep_rows, device=device)
                cache.batch_select_indices(keep)
                attention, positions = attention[keep], positions[keep]
                live = [live[row] for row in keep_rows]
            input_ids = torch.tensor(next_tokens, device=device).unsqueeze(1)
            attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=1)
            positions = positions[:, -1:] + 1
        return [
            Completion(tokens[i], logprobs[i], finish[i], self.weight_version)
            for i in range(len(requests))
        ]

    def _first_pass(self, input_ids, attention, positions, cache: DynamicCache,
                    cache_arg: str) -> torch.Tensor:
        """The last position's logits (float32) of the batch's first pass, which fills ``cache``.

        Rows that are one prompt (a GRPO group's copies, nothing taken from the prefix cache)
        run once: the pass feeds each distinct row, then every row gets its copy of that row's
        keys, values and logits.
        """
        # A pass over fewer rows may round the last bits differently, as any batching may.
        repeated = repeated_rows(input_ids, attention) if cache.get_seq_length() == 0 else None
        fed = slice(None) if repeated is None else repeated[0]
        real = int(attention[fed][:, -input_ids.shape[1]:].sum())
        self.prefill_tokens += input_ids[fed].numel()
        self.prefill_real_tokens += real
        self.repeated_prompt_tokens += int(attention[:, -input_ids.shape[1]:].sum()) - real
        out = self.model(input_ids=input_ids[fed], attention_mask=attention[fed],
                         position_ids=positions[fed],
                         use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        logits = out.logits[:, -1, :].float()
        if repeated is None:
            return logits
        cache.batch_select_indices(repeated[1])
        return logits[repeated[1]]

    def _prefill_inputs(self, requests: Sequence[_Request], device):
        """Input ids, attention mask and positions of the batch's first pass, and the KV
        cache it starts from.

        Rows are left-padded to the longest prompt. Where prompts start with a cached prefix,
        the first pass feeds only the last ``fed`` columns, ``fed`` being the longest part of
        any prompt that is not cached; every row's columns before those come from its cached
        prefix (a row whose prefix is longer than that recomputes the rest; a row without one
        is no longer than ``fed``).
        """
        prefixes = [None] * len(requests)
        if self.prefix_cache is not None:
            self.prefix_cache.check_weights(self.model)
            prefixes = [self.prefix_cache.take(r.prompt_ids) for r in requests]
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        fed = max(n - (p.length if p else 0) for n, p in zip(lengths, prefixes))
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):
            input_ids[row, width - lengths[row]:] = torch.tensor(request.prompt_ids)
            attention[row, width - lengths[row]:] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cached = width - fed  # columns whose keys and values come from the prefix cache
        key_values = None
        if cached:
            rows = [(p.key_values, max(0, n - fed)) if p else (None, 0)
                    for n, p in zip(lengths, prefixes)]
            key_values = _batch_key_values(rows, cached, device)
        self.cached_prompt_tokens += sum(max(0, n - fed) for n in lengths)
        # Buffers reserved ahead of the decode (kv_cache.py), where transformers' own cache
        # copies every key and value at every step; the model computes bitwise the same.
        if self.plain_cache:
            room = min(max(r.max_tokens for r in requests), RESERVED_AHEAD)
            cache = reserved_cache(self.model.config, width + room, key_values)
        else:
            cache = DynamicCache(ddp_cache_data=key_values, config=self.model.config)
        return input_ids[:, cached:], attention, positions[:, cached:], cache

    def _keep_prefix(self, cache: DynamicCache, row: int, token_ids: list[int]) -> None:
        """Store the keys and values of batch row ``row``, whose fed tokens are ``token_ids``
        (the last ones in every layer's cache; the columns before them are padding)."""
        # The row stopped on a resume token (a node's spawn call): the request that resumes the
        # node starts with these tokens and prefills only the clones' answers. Keys computed a
        # token at a time and in one prefill differ in their last bits, so a resumed node can
        # sample differently than without the cache, as it can when batched with other rows.
        if self.prefix_cache is None:
            return
        length = len(token_ids)
        self.prefix_cache.put(token_ids, [
            (layer.keys[row:row + 1, :, -length:].clone(),
             layer.values[row:row + 1, :, -length:].clone())
            for layer in cache.layers])

    def sync_weights(self, model=None) -> None:
        """Serve ``model``'s weights (load them if it is another object); bump the version."""
        if model is not None and model is not self.model:
            self.model.load_state_dict(model.state_dict())
        self.weight_version += 1

    def sleep(self) -> None:
        """Nothing to free: the backend decodes with the trainer's own model."""

    def close(self) -> None:
        """Nothing to release."""


def _batch_key_values(rows, width: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys and values of a batch whose rows are ``(key_values, used)``: the
    first ``used`` positions of a row's cached prefix, right-aligned in ``width`` columns
    (the columns before them are padding the attention mask hides)."""
    sample = next(kv for kv, used in rows if used)
    layers = []
    for layer, (keys, values) in enumerate(sample):
        batch_keys = keys.new_zeros((len(rows), keys.shape[1], width, keys.shape[3]), device=device)
        batch_values = values.new_zeros((len(rows), values.shape[1], width, values.shape[3]),
                                        device=device)
        for row, (key_values, used) in enumerate(rows):
            if used:
                batch_keys[row, :, width - used:] = key_values[layer][0][0, :, :used]
                batch_values[row, :, width - used:] = key_values[layer][1][0, :, :used]
        layers.append((batch_keys, batch_values))
    return layers


def sample_rows(
    logits: torch.Tensor, samplings: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits`` [rows, vocab]; return tokens and their logprobs.

    Each row uses its own sampling parameters and generator (inverse-CDF sampling with one
    uniform draw per row). Logprobs follow `SamplingParams`: ``log_softmax(logits / T)``
    before top-k/top-p truncation (and before banned tokens are removed); greedy rows report
    temperature-1 logprobs.
    """
    temperature = torch.tensor([s.temperature or 1.0 for s in samplings], device=logits.device)
    logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
    banned = [(row, token) for row, s in enumerate(samplings) for token in s.banned_token_ids]
    if banned:
        banned_at = tuple(torch.tensor(banned, device=logits.device).T)
        logits = logits.index_put(banned_at, torch.tensor(float("-inf"), device=logits.device))
    greedy = [s.greedy for s in samplings]
    if all(greedy):  # an argmax needs neither the sorted distribution nor a draw
        tokens = logits.argmax(-1)
    else:
        probs = logp.exp()
        if banned:
            probs = probs.index_put(banned_at, torch.zeros((), device=logits.device))
        tokens = _draw(probs, samplings, generators)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(-1),
                                 tokens)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _draw(probs: torch.Tensor, samplings: Sequence[SamplingParams],
          generators: Sequence[torch.Generator]):
    """Inverse-CDF draws over each row's probabilities sorted in descending order, truncated
    by the row's top-k and top-p; one uniform of the row's generator each."""
    vocab = probs.shape[-1]
    top_k = torch.tensor([s.top_k or vocab for s in samplings], device=probs.device)
    top_p = torch.tensor([s.top_p for s in samplings], device=probs.device)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    if (top_k < vocab).any() or (top_p < 1).any():
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        # Keep the top_k most likely tokens and the smallest prefix whose mass reaches top_p
        # (the most likely token always stays).
        drop = ((ranks >= top_k[:, None])
                | (sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]))
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    cdf = sorted_probs.cumsum(-1)
    uniform = torch.stack([torch.rand((), generator=g) for g in generators]).to(probs.device)
    ranks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None],
                               right=True).clamp(max=vocab - 1)
    return order.gather(1, ranks).squeeze(1)
