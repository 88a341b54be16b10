"""How far a GRPO step of `benchmarks/vs_trl.py`'s workload is from the machine's matmul rate.

For each model of that benchmark, with one torch thread:

1. **Decode**: `HFBackend` samples 32 rows × 64 new tokens (the benchmark's step) from
   one prompt of the workload's length, which it prefills once for all 32 rows.
2. **Update**: one forward and backward of the policy loss over the same 32 rows, logits
   from the first sampled position on, as the trainer computes them, every row run whole
   (the trainer runs a group's shared prompt once, `trainer.share_prompt_forward`; this
   counts the work of the rows, not what sharing saves).

Each is timed (median of ``--repeats``) and its floating-point operations counted by
`torch.utils.flop_counter` (matmuls and attention). Its **ceiling** is one matmul of the
model's MLP up-projection shape with as many rows as the phase feeds (32 a decode pass,
32 × sequence length an update), timed in the same run: the time the counted work would
take at that rate is the phase's compute floor, and the rest is overhead (Python, small
ops, memory traffic) that no change of batching removes.

    python benchmarks/roofline.py [--model small large] [--repeats 5]

Simplification: the ceiling is one shape's rate; the model's other matmuls (attention
projections, the output layer) are smaller and run somewhat slower, so the floor is a
little optimistic.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
# noqa: E402
from vs_trl import GROUP, MAX_NEW_TOKENS, MODELS, PROMPTS_PER_STEP, VOCAB, prompts, random_qwen2

from selfcest.modeling import forward_logprobs  # noqa: E402
from selfcest.policy import build_tokenizer  # noqa: E402
from selfcest.rollout.backends.base import SamplingParams  # noqa: E402
from selfcest.rollout.backends.hf import HFBackend  # noqa: E402

ROWS = PROMPTS_PER_STEP * GROUP


def median_seconds(work, repeats: int) -> float:
    """Median wall time of ``work()`` over ``repeats`` calls, after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def counted_flops(work) -> int:
    """Floating-point operations of one call of ``work()``."""
    with FlopCounterMode(display=False) as counter:
        work()
    return counter.get_total_flops()


def matmul_rate(rows: int, inner: int, outer: int, repeats: int) -> float:
    """FLOP/s of a [rows, inner] × [inner, outer] matmul (enough calls for ~50 ms each)."""
    a, b = torch.randn(rows, inner), torch.randn(inner, outer)
    calls = max(1, int(2e9 / (2 * rows * inner * outer)))
    seconds = median_seconds(lambda: [a @ b for _ in range(calls)], repeats)
    return calls * 2 * rows * inner * outer / seconds


def decode_work(model, prompt_ids: list[int]):
    """One decode of the benchmark's step: ROWS concurrent requests, MAX_NEW_TOKENS tokens
    each, T=1, no stop token, which the backend batches as the engine's requests."""
    backend = HFBackend(model, pad_token_id=0, prefix_cache_mb=0)
    seeds = iter(range(10**9))

    async def batch():
        await asyncio.gather(*(
            backend.generate(prompt_ids, max_tokens=MAX_NEW_TOKENS, stop_token_ids=(),
                             sampling=SamplingParams(1.0), seed=next(seeds))
            for _ in range(ROWS)))
    return lambda: asyncio.run(batch())


def update_work(model, prompt_ids: list[int], vocab_size: int):
    """One forward and backward of a token-mean policy loss over ROWS sequences of the
    prompt and MAX_NEW_TOKENS random tokens, through the trainer's own forward
    (`selfcest.modeling.forward_logprobs`, logits from the first sampled position on)."""
    generator = torch.Generator().manual_seed(0)
    completion = torch.randint(0, vocab_size, (ROWS, MAX_NEW_TOKENS), generator=generator)
    ids = torch.cat([torch.tensor(prompt_ids).expand(ROWS, -1), completion], dim=1)

    def work():
        logprobs = forward_logprobs(model, ids, torch.ones_like(ids),
                                    from_position=len(prompt_ids))[0]
        (-logprobs[:, len(prompt_ids):].mean()).backward()
        model.zero_grad(set_to_none=True)
    return work


def measure(name: str, repeats: int) -> list[dict]:
    """Both phases of one model: positions fed, seconds, GFLOP, achieved and ceiling rates
    (GFLOP/s), compute floor (seconds)."""
    tokenizer = build_tokenizer(vocab_size=VOCAB, protocol_tokens=False)
    prompt = prompts()[0][0]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    model = random_qwen2(name, len(tokenizer))
    hidden, intermediate = MODELS[name][0], MODELS[name][4]
    rows = []
    # Positions each phase feeds through the model: a decode prefills the prompt once (its
    # 32 rows repeat it) and feeds every row's sampled tokens but the last; an update feeds
    # prompt and completion of every row at once.
    fed = {"decode": len(prompt_ids) + ROWS * (MAX_NEW_TOKENS - 1),
           "update": ROWS * (len(prompt_ids) + MAX_NEW_TOKENS)}
    for phase, work, matmul_rows in (
        ("decode", decode_work(model, prompt_ids), ROWS),
        ("update", update_work(model, prompt_ids, len(tokenizer)), fed["update"]),
    ):
        model.train(phase == "update")
        seconds = median_seconds(work, repeats)
        flops = counted_flops(work)
        ceiling = matmul_rate(matmul_rows, hidden, intermediate, repeats)
        rows.append({"model": name, "phase": phase, "tokens": fed[phase], "seconds": seconds,
                     "gflop": flops / 1e9,
                     "rate": flops / seconds / 1e9, "ceiling": ceiling / 1e9,
                     "floor_seconds": flops / ceiling})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["small", "large"], choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each phase (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':6s} {'phase':7s} {'seconds':>8s} {'GFLOP':>7s} {'GFLOP/s':>8s} {'ceiling':>8s}"
          f" {'of ceiling':>10s} {'floor s':>8s} {'overhead s':>10s}")
    for name in args.model:
        for row in measure(name, args.repeats):
            print(f"{row['model']:6s} {row['phase']:7s} {row['seconds']:8.3f} {row['gflop']:7.1f}"
                  f" {row['rate']:8.1f} {row['ceiling']:8.1f} {row['rate'] / row['ceiling']:10.2f}"
                  f" {row['floor_seconds']:8.3f} {row['seconds'] - row['floor_seconds']:10.3f}")


if __name__ == "__main__":
    main()
