"""Decoding into reserved KV buffers against transformers' DynamicCache, in `HFBackend`.

`HFBackend` keeps a decode's keys and values in `ReservedLayer`s
(`selfcest/rollout/backends/kv_cache.py`): buffers allocated once, each step written in
place. transformers' `DynamicLayer` concatenates each step to the whole cache instead, which
copies it, so what the buffers save grows with the context. This times the same decode both
ways, alternating, in one process with one torch thread: ``--rows`` requests (groups of
four copies of one prompt, as a GRPO step sends them), each ``--new-tokens`` tokens at T=1
with no stop token, from prompts of ``--prompt-tokens`` random tokens. It prints every pair,
whether both ways drew the same tokens with bitwise the same logprobs, and the ratio of
the medians (reserved / dynamic).

    python benchmarks/decode_cache.py [--model smollm2 large] [--prompt-tokens 256]
                                      [--new-tokens 96] [--rows 32] [--pairs 3]

Models, random weights (only shapes matter for time): ``smollm2``, a Llama in the shape of
SmolLM2-135M (hidden 576, 30 layers, 9 heads, 3 key/value heads, vocabulary 49,152), and
``large``, the 8.49M Qwen2 of `benchmarks/vs_trl.py` (its 492-token vocabulary).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import GROUP, SEED, random_qwen2  # noqa: E402

from selfcest.rollout.backends import hf  # noqa: E402
from selfcest.rollout.backends.base import SamplingParams  # noqa: E402

LARGE_VOCAB = 492  # the vocabulary vs_trl's tokenizer ends up with


def smollm2_shaped():
    """A random Llama with SmolLM2-135M's shape."""
    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


MODELS = {"smollm2": smollm2_shaped, "large": lambda: random_qwen2("large", LARGE_VOCAB)}


def dynamic_cache(config, capacity: int, key_values=None) -> DynamicCache:
    """What the backend built before it reserved room: transformers' own cache."""
    return DynamicCache(ddp_cache_data=key_values, config=config)


def decode(model, prompts: list[list[int]], new_tokens: int, seed: int, cache_factory):
    """One batch of the backend's decode with ``cache_factory`` in place of
    `reserved_cache`: its seconds and its completions."""
    backend = hf.HFBackend(model, pad_token_id=0, prefix_cache_mb=0)
    original = hf.reserved_cache
    hf.reserved_cache = cache_factory
    seeds = iter(range(seed * 10**6, (seed + 1) * 10**6))

    async def batch():
        return await asyncio.gather(*(
            backend.generate(prompt, max_tokens=new_tokens, stop_token_ids=(),
                             sampling=SamplingParams(1.0),
                             seed=next(seeds))
            for prompt in prompts for _ in range(GROUP)))
    try:
        start = time.perf_counter()
        completions = asyncio.run(batch())
        return time.perf_counter() - start, completions
    finally:
        hf.reserved_cache = original


def compare(name: str, prompt_tokens: int, new_tokens: int, rows: int, pairs: int) -> dict:
    """Alternate the two caches ``pairs`` times (order swapped every pair); the medians,
    their ratio, and whether every pair drew the same tokens and logprobs."""
    model = MODELS[name]().eval()
    generator = torch.Generator().manual_seed(SEED)
    vocab = model.config.vocab_size
    # Prompts one token apart in length, so that the batch is left-padded.
    prompts = [torch.randint(1, vocab, (prompt_tokens - i,), generator=generator).tolist()
               for i in range(rows // GROUP)]
    seconds = {"reserved": [], "dynamic": []}
    identical = True
    for pair in range(pairs):
        order = ("reserved", "dynamic") if pair % 2 == 0 else ("dynamic", "reserved")
        drawn = {}
        for way in order:
            factory = hf.reserved_cache if way == "reserved" else dynamic_cache
            elapsed, completions = decode(model, prompts, new_tokens, pair, factory)
            seconds[way].append(elapsed)
            drawn[way] = [(c.token_ids, c.logprobs) for c in completions]
        identical &= drawn["reserved"] == drawn["dynamic"]
        print(f"{name} pair {pair}: reserved {seconds['reserved'][-1]:.3f} s, dynamic "
              f"{seconds['dynamic'][-1]:.3f} s",
              flush=True)
    medians = {way: statistics.median(times) for way, times in seconds.items()}
    return {"model": name, **medians, "ratio": medians["reserved"] / medians["dynamic"],
            "identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2", "large"], choices=sorted(MODELS))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rows", type=int, default=32, help="requests a batch (a multiple of 4)")
    parser.add_argument("--pairs", type=int, default=3, help="decodes of each way, alternating")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [compare(name, args.prompt_tokens, args.new_tokens, args.rows, args.pairs)
               for name in args.model]
    print(f"{'model':8s} {'reserved s':>10s} {'dynamic s':>10s} {'ratio':>6s}  same tokens and "
          "logprobs")
    for r in results:
        print(f"{r['model']:8s} {r['reserved']:10.3f} {r['dynamic']:10.3f} {r['ratio']:6.3f}  "
              f"{r['identical']}")


if __name__ == "__main__":
    main()
