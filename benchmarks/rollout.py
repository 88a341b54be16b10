"""Rollout efficiency: clone trees against flat generation and against one branch at a time.

Four ways to generate on the same model, measured in the same run (best of ``--repeats``):

- trees: the `RolloutEngine` expands a batch of clone trees, every branch that waits for
  tokens decoded together (`HFBackend`), a node that resumes after its clones reusing the
  KV cache it stopped with;
- trees without the prefix cache: the same, every resumed node prefilling its whole context;
- flat: one batched generation of as many sequences as trees, together producing the same
  number of generated tokens (the best case for the hardware);
- one branch at a time: the same trees expanded with a batch size of one.

    python benchmarks/rollout.py [--policy runs/cpu_repro/sft] [--tasks 64]

The policy must really delegate: by default the warm start of the CPU reproduction (run
``make run`` first). The budget and tasks are that experiment's. Reports ratios, not
absolute speeds.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from selfcest.budget import Budget
from selfcest.policy import ClonePolicy
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.hf import HFBackend
from selfcest.rollout.engine import RolloutEngine
from selfcest.tasks import load_tasks

BUDGET = Budget(node_generation=128, clone_generation=96, node_context=192, tree_generation=1024,
                max_depth=3, clones_per_spawn=4, clones_per_tree=16, spawn_rounds=1)
GREEDY = SamplingParams(temperature=0)


def tokens_of(tree) -> dict[str, list[int]]:
    """Every node's context token ids (logprobs of padded and unpadded batches differ in
    their last bits, so trees are compared on tokens)."""
    return {node_id: node.context_ids() for node_id, node in tree.nodes.items()}


def time_trees(policy, tasks, batch_size: int, prefix_cache_mb: float = 512):
    backend = HFBackend(policy.model, policy.tokenizer.pad_token_id, max_batch_size=batch_size,
                        prefix_cache_mb=prefix_cache_mb)
    engine = RolloutEngine(backend, policy.protocol, BUDGET, GREEDY)
    start = time.perf_counter()
    trees = engine.rollout(tasks)
    return time.perf_counter() - start, trees, backend


def time_flat(policy, tasks, tokens_per_row: int) -> tuple[float, HFBackend]:
    """One batch of root prompts, each generating ``tokens_per_row`` tokens (no stops)."""
    backend = HFBackend(policy.model, policy.tokenizer.pad_token_id, max_batch_size=len(tasks))

    async def generate_all():
        return await asyncio.gather(*(
            backend.generate(policy.protocol.root_prompt(t), max_tokens=tokens_per_row,
                             stop_token_ids=[], sampling=GREEDY, seed=0) for t in tasks))

    start = time.perf_counter()
    asyncio.run(generate_all())
    assert backend.batches == 1
    return time.perf_counter() - start, backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="runs/cpu_repro/sft", help="a saved delegating policy")
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = ClonePolicy.from_pretrained(args.policy)
    tasks = load_tasks("keyed_sum", split="test", n_train=2000, n_test=200, n_ood=0,
                       train={"num_keys": 4, "list_len": 3, "max_value": 3})[: args.tasks]

    tree_times, uncached_times, serial_times, flat_times = [], [], [], []
    for _ in range(args.repeats):  # alternating, so that load drifts hit every way alike
        elapsed, trees, backend = time_trees(policy, tasks, batch_size=256)
        tree_times.append(elapsed)
        elapsed, uncached_trees, uncached = time_trees(policy, tasks, batch_size=256,
                                                       prefix_cache_mb=0)
        uncached_times.append(elapsed)
        generated = sum(t.costs().generated_tokens for t in trees)
        elapsed, flat = time_flat(policy, tasks, round(generated / len(tasks)))
        flat_times.append(elapsed)
        elapsed, serial, _ = time_trees(policy, tasks, batch_size=1)
        serial_times.append(elapsed)
    same = [tokens_of(a) == tokens_of(b) for a, b in zip(trees, serial)]
    same_uncached = [tokens_of(a) == tokens_of(b) for a, b in zip(trees, uncached_trees)]
    t_tree, t_uncached, t_flat, t_serial = (min(tree_times), min(uncached_times), min(flat_times),
                                            min(serial_times))
    clones = sum(t.costs().clones for t in trees) / len(trees)
    print(f"{len(trees)} trees, {clones:.1f} clones each, {generated} generated tokens; "
          f"{backend.batches} batches, {backend.forward_passes} forward passes; trees identical: "
          f"{sum(same)}/{len(same)} expanded one branch at a time, "
          f"{sum(same_uncached)}/{len(same_uncached)} without the prefix cache")
    print(f"trees                  {t_tree:7.2f} s   {generated / t_tree:8.0f} tokens/s")
    print(f"trees, no prefix cache {t_uncached:7.2f} s   {generated / t_uncached:8.0f} tokens/s")
    print(f"flat, same tokens      {t_flat:7.2f} s   {generated / t_flat:8.0f} tokens/s")
    print(f"one branch at a time   {t_serial:7.2f} s   {generated / t_serial:8.0f} tokens/s")
    print(f"trees / flat = {t_tree / t_flat:.2f}x the time (without the prefix cache "
          f"{t_uncached / t_flat:.2f}x);  one-at-a-time / trees = {t_serial / t_tree:.1f}x")
    # Where the trees' extra time goes (last repeat): the clones' own prompts, what resumed
    # nodes still prefill, and waves that decode fewer rows per pass than one batch.
    for name, b in (("trees", backend), ("trees, no prefix cache", uncached), ("flat", flat)):
        print(f"{name}: {b.batches} batches, {b.forward_passes} forward passes, {b.prefill_tokens} "
              f"prefilled tokens ({b.prefill_real_tokens} without padding; "
              f"{b.cached_prompt_tokens} taken from the prefix cache) in {b.prefill_seconds:.2f} s")


if __name__ == "__main__":
    main()
