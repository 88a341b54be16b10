"""From credited clone trees to padded micro-batches under a token budget.

One `TrainingSample` per node: the node's full context, trained only on the tokens it
sampled. Samples are grouped into micro-batches by a **token budget** (rows x longest row),
not by a row count, after sorting by length so rows of one micro-batch have similar lengths
and padding stays small. A training step runs a **fixed** number of optimizer steps
(`split_for_optimizer_steps`), however many clones the trees hold.

Alignment: every per-token list and tensor here is *input-aligned*, as in
`selfcest.algo.losses`: position t is about token ``input_ids[t]`` (``loss_mask[t] = 1`` iff
that token was sampled, ``old_logprobs[t]`` its logprob at sampling time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfcest.algo.advantages import Advantages
from selfcest.tree import CloneTree


@dataclass
class TrainingSample:
    """One node of one tree, as the trainer sees it."""

    # The node's full context: prompt tokens, then every segment's tokens in order.
    input_ids: list[int]
    # 1 where input_ids[t] was sampled by this node; 0 on prompt, return and notice tokens.
    loss_mask: list[int]
    # Logprob of input_ids[t] under the sampling weights where loss_mask[t] == 1, else 0.0.
    old_logprobs: list[float]
    # The node's advantage (`selfcest.algo.advantages`), the same for all its tokens.
    advantage: float
    # Index of the node's tree in the step's list of trees (groups samples for tree_mean).
    tree_id: int
    # The node's id in its tree ("0", "0.1", ...).
    node_id: str
    # Weight version the tokens were sampled under (None if the backend does not track it).
    weight_version: int | None

    def __post_init__(self) -> None:
        if not len(self.input_ids) == len(self.loss_mask) == len(self.old_logprobs):
            raise ValueError(
                f"sample {self.tree_id}/{self.node_id}: input_ids, loss_mask and old_logprobs "
                f"must have one entry per token ({len(self.input_ids)}, {len(self.loss_mask)}, "
                f"{len(self.old_logprobs)})"
            )

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)


def samples_from_trees(trees: Sequence[CloneTree], advantages: Advantages) -> list[TrainingSample]:
    """One sample per node of every kept tree, in tree order then node order.

    Nodes that sampled no token (a node that failed before its first call) are skipped;
    prompt tokens and injected segments (``return``, ``notice``) get mask 0.
    """
    if len(trees) != len(advantages.keep):
        raise ValueError(f"{len(trees)} trees but advantages for {len(advantages.keep)}")
    samples = []
    for tree_id, tree in enumerate(trees):
        if not advantages.keep[tree_id]:
            continue
        credit = advantages.per_tree[tree_id]
        for node in tree.nodes.values():
            if node.generated_tokens == 0:
                continue
            if node.id not in credit:
                raise ValueError(
                    f"no advantage for node {node.id} of tree {tree.task_id}#{tree.sample_index}"
                )
            input_ids = list(node.prompt_ids)
            loss_mask = [0] * len(input_ids)
            old_logprobs = [0.0] * len(input_ids)
            for segment in node.segments:
                input_ids.extend(segment.token_ids)
                if segment.trainable:
                    loss_mask.extend([1] * len(segment.token_ids))
                    old_logprobs.extend(segment.logprobs)
                else:
                    loss_mask.extend([0] * len(segment.token_ids))
                    old_logprobs.extend([0.0] * len(segment.token_ids))
            version = tree.weight_version if node.weight_version is None else node.weight_version
            samples.append(
                TrainingSample(input_ids, loss_mask, old_logprobs, credit[node.id], tree_id,
                               node.id, version)
            )
    return samples


def make_micro_batches(
    lengths: Sequence[int],
    max_tokens_per_micro_batch: int,
    *,
    pass_overhead_tokens: int = 512,
    oversize: str = "alone",
) -> list[list[int]]:
    """Group sample indices so each micro-batch's padded size fits the token budget.

    The padded size of a micro-batch is ``rows x longest row``; it never exceeds
    ``max_tokens_per_micro_batch``. Samples are sorted by length, longest first (ties by
    index, so the result is deterministic), and cut into runs of neighbours in length. The
    cut is the exact minimum (a dynamic program over cut points) of

        sum over micro-batches of (rows x longest row) + pass_overhead_tokens

    i.e. the compute of the padded tokens plus a fixed cost per forward/backward pass,
    expressed in tokens (weight reads and kernel launches; a few hundred tokens on a GPU),
    ties going to fewer micro-batches. So a micro-batch is split where the padding that
    saves outweighs one more pass, which greedy filling cannot do: it leaves length jumps,
    such as roots next to clones, inside micro-batches. ``pass_overhead_tokens >= budget``
    gives the fewest micro-batches (an extra one can never save more than a budget of
    padding); 0 gives one sample per micro-batch. Micro-batches come longest first.

    A sample longer than the budget fits no micro-batch: ``oversize="alone"`` gives it one
    of its own (the one case where the budget is exceeded; lengths are bounded by the
    context budget anyway), ``oversize="raise"`` raises.
    """
    budget = max_tokens_per_micro_batch
    if budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {budget}")
    if pass_overhead_tokens < 0:
        raise ValueError(f"pass_overhead_tokens must be >= 0, got {pass_overhead_tokens}")
    if oversize not in ("alone", "raise"):
        raise ValueError(f"oversize must be 'alone' or 'raise', got {oversize!r}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    alone = [[i] for i in order if lengths[i] > budget]
    if alone and oversize == "raise":
        i = alone[0][0]
        raise ValueError(
            f"sample {i} has {lengths[i]} tokens, more than max_tokens_per_micro_batch = {budget}"
        )
    fitting = [i for i in order if lengths[i] <= budget]
    # best[j] = (cost, micro-batches) of the best cut of fitting[:j]; cut[j] = start of its
    # last micro-batch. A run fitting[i:j] is padded to its first (longest) row, so it fits
    # iff (j - i) * length(fitting[i]) <= budget, and once a start i fails, every earlier
    # start fails too (longer rows, and more of them).
    best: list[tuple[int, int]] = [(0, 0)]
    cut: list[int] = [0]
    for j in range(1, len(fitting) + 1):
        candidate, start = None, j - 1
        for i in range(j - 1, -1, -1):
            padded = (j - i) * lengths[fitting[i]]
            if padded > budget:
                break
            cost = (best[i][0] + padded + pass_overhead_tokens, best[i][1] + 1)
            if candidate is None or cost < candidate:
                candidate, start = cost, i
        best.append(candidate)
        cut.append(start)
    runs = []
    j = len(fitting)
    while j > 0:
        runs.append(fitting[cut[j] : j])
        j = cut[j]
    return alone + runs[::-1]


def padding_fraction(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> float:
    """Share of padded positions: ``1 - real tokens / sum(rows x longest row)``."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in micro_batches if b)
    real = sum(lengths[i] for b in micro_batches for i in b)
    return 1.0 - real / padded if padded else 0.0


def split_for_optimizer_steps(
    micro_batches: Sequence[Sequence[int]], num_steps: int, tokens: Sequence[int]
) -> list[list[list[int]]]:
    """Distribute micro-batches over exactly ``num_steps`` optimizer steps, balanced by tokens.

    ``tokens[i]`` is sample i's token count (its trainable tokens, to balance what each
    update learns from). Returns one list of micro-batches per step. While there are fewer
    micro-batches than steps, the one with most tokens is halved by rows (alternate rows of
    a length-sorted batch, so the halves carry similar tokens; a half never pads more than
    the whole). Then the largest micro-batch goes to the least-loaded step, repeatedly
    (LPT). Only with fewer samples than steps do some steps stay empty, for the trainer to
    skip. The step count never depends on how many clones the trees spawned
    (docs/reference.md §9.17).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    batches = [list(b) for b in micro_batches if b]

    def load(batch: Sequence[int]) -> int:
        return sum(tokens[i] for i in batch)

    while len(batches) < num_steps:
        splittable = [b for b in batches if len(b) > 1]
        if not splittable:
            break
        largest = max(splittable, key=load)
        batches.remove(largest)
        batches += [largest[0::2], largest[1::2]]

    steps: list[list[list[int]]] = [[] for _ in range(num_steps)]
    step_load = [0] * num_steps
    for batch in sorted(batches, key=lambda b: (-load(b), b[0])):
        target = min(range(num_steps), key=lambda s: (step_load[s], s))
        steps[target].append(batch)
        step_load[target] += load(batch)
    return steps


@dataclass
class MicroBatch:
    """Right-padded tensors of one micro-batch; per-token tensors are ``[rows, T]``."""

    input_ids: torch.Tensor  # long; pad_token_id after each row's end
    attention_mask: torch.Tensor  # long; 1 on real tokens
    loss_mask: torch.Tensor  # float; 1 on sampled tokens (never on padding)
    old_logprobs: torch.Tensor  # float32; 0 off the loss mask
    advantages: torch.Tensor  # float32 [rows]; one per sample
    # float32; the sample's aggregation weight on its sampled tokens, 0 elsewhere, so
    # (loss_per_token * token_weights).sum() is this micro-batch's share of the step's loss.
    token_weights: torch.Tensor

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(**{name: t.to(device) for name, t in vars(self).items()})


def collate(
    samples: Sequence[TrainingSample], weights: Sequence[float], pad_token_id: int = 0
) -> MicroBatch:
    """Right-pad samples to the longest one; ``weights`` from `aggregation_weights`."""
    if len(samples) != len(weights):
        raise ValueError(f"{len(samples)} samples but {len(weights)} weights")
    rows, width = len(samples), max(s.length for s in samples)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.float32)
    old_logprobs = torch.zeros((rows, width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = sample.length
        input_ids[row, :n] = torch.tensor(sample.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        old_logprobs[row, :n] = torch.tensor(sample.old_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    token_weights = loss_mask * torch.tensor(weights, dtype=torch.float32)[:, None]
    return MicroBatch(input_ids, attention_mask, loss_mask, old_logprobs, advantages, token_weights)
