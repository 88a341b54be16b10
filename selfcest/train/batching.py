"""From credited clone trees to padded micro-batches under a token budget.

One `TrainingSample` per node: the node's full context, trained only on the tokens it
sampled. Samples are grouped into micro-batches by a **token budget** (rows x longest row),
not by a row count, after sorting by length so rows of one micro-batch have similar lengths
and padding stays small. With **packing** (`trainer.packing`, off by default), several samples share
a
row: each keeps its own positions (0, 1, ...) and transformers' attention masks keep them
apart (`selfcest.modeling.supports_packing` checks that a model does), so only row ends are
padded. A training step runs a **fixed** number of optimizer steps
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
    # Index in input_ids of the root's decision whether to delegate: its first token, when
    # the root sampled it (None for clones, and for a root whose turn began prefilled).
    decision_at: int | None = None

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

    @property
    def prompt(self) -> tuple[int, ...]:
        """Its tokens before its first sampled one: what rows of one prompt share."""
        first = self.loss_mask.index(1) if 1 in self.loss_mask else self.length
        return tuple(self.input_ids[:first])


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
            first = len(node.prompt_ids)
            decides = node.parent_id is None and first < len(input_ids) and loss_mask[first] == 1
            samples.append(
                TrainingSample(input_ids, loss_mask, old_logprobs, credit[node.id], tree_id,
                               node.id, version, first if decides else None)
            )
    return samples


def make_micro_batches(
    lengths: Sequence[int],
    max_tokens_per_micro_batch: int,
    *,
    pass_overhead_tokens: int = 512,
    oversize: str = "alone",
    prompts: Sequence[tuple[int, ...]] | None = None,
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

    ``prompts`` (one per sample: its tokens before its first sampled one), where the
    update runs a micro-batch's shared prompt columns once per distinct prompt
    (`selfcest.modeling.shared_prefix_logits`, ``trainer.share_prompt_forward``): a run's
    compute is then ``rows x longest row - (rows - distinct prompts) x shared``, ``shared``
    being the columns before the run's first trained position (its shortest prompt less
    one). Without it, a GRPO step whose few short completions make a micro-batch of their
    own runs their groups' prompts twice and saves less padding than that costs. Prompts
    are told apart whole, so prompts that agree only on their first columns count as
    distinct (the cost is then an upper bound). The budget still bounds rows x longest row.

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
    ids = {prompt: k for k, prompt in enumerate(dict.fromkeys(prompts or ()))}
    prompt_id = None if prompts is None else [ids[prompt] for prompt in prompts]
    # best[j] = (cost, micro-batches) of the best cut of fitting[:j]; cut[j] = start of its
    # last micro-batch. A run fitting[i:j] is padded to its first (longest) row, so it fits
    # iff (j - i) * length(fitting[i]) <= budget, and once a start i fails, every earlier
    # start fails too (longer rows, and more of them).
    best: list[tuple[int, int]] = [(0, 0)]
    cut: list[int] = [0]
    for j in range(1, len(fitting) + 1):
        candidate, start = None, j - 1
        distinct, shortest = set(), None  # prompts of the run fitting[i:j], as i goes down
        for i in range(j - 1, -1, -1):
            padded = (j - i) * lengths[fitting[i]]
            if padded > budget:
                break
            computed = padded
            if prompt_id is not None:
                distinct.add(prompt_id[fitting[i]])
                prompt = len(prompts[fitting[i]])
                shortest = prompt if shortest is None else min(shortest, prompt)
                computed -= (j - i - len(distinct)) * max(shortest - 1, 0)
            cost = (best[i][0] + computed + pass_overhead_tokens, best[i][1] + 1)
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


def packed_micro_batches(lengths: Sequence[int],
                         max_tokens_per_micro_batch: int) -> list[list[int]]:
    """Group sample indices for packed rows of `packing_width` tokens; each micro-batch holds
    at most ``max_tokens_per_micro_batch // width`` rows, so its padded size (rows x width)
    fits the budget.

    Samples are placed first-fit into rows, longest first (first-fit decreasing: few rows,
    hence little padding), and consecutive rows form a micro-batch. A micro-batch is its
    rows' samples in row order, the order `pack_rows` cuts back into (at most) those rows.
    A sample longer than the budget gets a micro-batch of its own, as in `make_micro_batches`.
    """
    budget = max_tokens_per_micro_batch
    if budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    alone = [[i] for i in order if lengths[i] > budget]
    width = packing_width(lengths, budget)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in (i for i in order if lengths[i] <= budget):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(width)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    per_batch = budget // width if width else 1
    batches = [sum(rows[k : k + per_batch], []) for k in range(0, len(rows), per_batch)]
    return alone + batches


def packing_width(lengths: Sequence[int], max_tokens_per_micro_batch: int) -> int:
    """Row width of packed micro-batches: the longest sample that fits the budget (a row must
    hold any one sample), or the longest sample if none fits."""
    fitting = [n for n in lengths if n <= max_tokens_per_micro_batch]
    return max(fitting or lengths or [0])


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Cut positions ``0..len(lengths)-1``, in order, into rows of at most ``width`` tokens:
    a sample joins the current row if it fits, else starts the next one (a sample longer than
    ``width`` gets a row of its own). Keeping the order, this greedy cut uses the fewest rows,
    so it never needs more rows than the packing `packed_micro_batches` made."""
    rows: list[list[int]] = []
    used = width
    for position, n in enumerate(lengths):
        if used + n > width or not rows:
            rows.append([])
            used = 0
        rows[-1].append(position)
        used += n
    return rows


def padding_fraction(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]],
                     pack_width: int | None = None) -> float:
    """Share of padded positions: ``1 - real tokens / sum(rows x longest row)``; with
    ``pack_width``, rows are the packed rows `collate` builds."""
    padded = real = 0
    for batch in micro_batches:
        if not batch:
            continue
        sizes = [lengths[i] for i in batch]
        rows = ([[k] for k in range(len(sizes))] if pack_width is None
                else pack_rows(sizes, pack_width))
        padded += len(rows) * max(sum(sizes[k] for k in row) for row in rows)
        real += sum(sizes)
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
    """Right-padded tensors of one micro-batch; per-token tensors are ``[rows, T]``.

    Unpacked, row r is sample r. Packed, a row holds several samples one after the other,
    each with its own positions from 0, and no attention mask: transformers then lets a
    token attend only within its own sample (detected from where positions restart).
    """

    input_ids: torch.Tensor  # long; pad_token_id after each row's end
    position_ids: torch.Tensor  # long; every sample counts from 0 (padding too)
    attention_mask: torch.Tensor | None  # long, 1 on real tokens; None when packed
    loss_mask: torch.Tensor  # float; 1 on sampled tokens (never on padding)
    old_logprobs: torch.Tensor  # float32; 0 off the loss mask
    advantages: torch.Tensor  # float32; each token its sample's advantage, 0 on padding
    # float32; the sample's aggregation weight on its sampled tokens, 0 elsewhere, so
    # (loss_per_token * token_weights).sum() is this micro-batch's share of the step's loss.
    token_weights: torch.Tensor
    # Where each sample lies, in input order: (row, first column, length).
    spans: list[tuple[int, int, int]]
    # float; 1 on each root's decision token (`TrainingSample.decision_at`), 0 elsewhere.
    decision_mask: torch.Tensor

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                 for name, value in vars(self).items()}
        return MicroBatch(**moved)

    def first_trained_position(self) -> int:
        """The first column where any row has a sampled token (the logprobs wanted start there)."""
        trained = self.loss_mask.any(0).nonzero()
        return int(trained[0]) if len(trained) else 0

    def per_sample(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Each sample's slice of a per-token ``[rows, T]`` tensor, in input order."""
        return [values[row, start : start + n] for row, start, n in self.spans]

    def place(self, per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
        """The inverse of `per_sample`: a ``[rows, T]`` float32 tensor, 0 off the samples."""
        out = torch.zeros(self.input_ids.shape, dtype=torch.float32, device=self.input_ids.device)
        for (row, start, n), values in zip(self.spans, per_sample):
            out[row, start : start + n] = values.to(out.device)
        return out


def collate(
    samples: Sequence[TrainingSample],
    weights: Sequence[float],
    pad_token_id: int = 0,
    pack_width: int | None = None,
) -> MicroBatch:
    """Right-pad samples into rows; ``weights`` from `aggregation_weights`.

    One sample per row, padded to the longest, unless ``pack_width`` is given: then samples
    share rows of up to that many tokens (`pack_rows`, in the given order).
    """
    if len(samples) != len(weights):
        raise ValueError(f"{len(samples)} samples but {len(weights)} weights")
    lengths = [s.length for s in samples]
    rows = ([[k] for k in range(len(samples))] if pack_width is None
            else pack_rows(lengths, pack_width))
    width = max(sum(lengths[k] for k in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    old_logprobs = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    token_weights = torch.zeros(shape, dtype=torch.float32)
    decision_mask = torch.zeros(shape, dtype=torch.float32)
    spans: list[tuple[int, int, int]] = [(0, 0, 0)] * len(samples)
    for r, row in enumerate(rows):
        start = 0
        for k in row:
            sample, end = samples[k], start + lengths[k]
            spans[k] = (r, start, lengths[k])
            input_ids[r, start:end] = torch.tensor(sample.input_ids, dtype=torch.long)
            position_ids[r, start:end] = torch.arange(lengths[k])
            attention_mask[r, start:end] = 1
            loss_mask[r, start:end] = torch.tensor(sample.loss_mask, dtype=torch.float32)
            old_logprobs[r, start:end] = torch.tensor(sample.old_logprobs, dtype=torch.float32)
            advantages[r, start:end] = sample.advantage
            token_weights[r, start:end] = loss_mask[r, start:end] * weights[k]
            if sample.decision_at is not None:
                decision_mask[r, start + sample.decision_at] = 1.0
            start = end
        # Padding counts from 0 as a sample of its own, so no real token attends to it.
        position_ids[r, start:] = torch.arange(width - start)
    return MicroBatch(input_ids, position_ids, None if pack_width is not None else attention_mask,
                      loss_mask, old_logprobs, advantages, token_weights, spans, decision_mask)
