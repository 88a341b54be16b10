"""Training samples, token-budget micro-batches, optimizer-step splits and collation."""

from __future__ import annotations

import random

import pytest
import torch

from selfcest.algo.advantages import Advantages, CreditConfig, compute_advantages
from selfcest.algo.losses import LossConfig, aggregation_weights, per_token_loss
from selfcest.train.batching import (
    TrainingSample,
    collate,
    make_micro_batches,
    pack_rows,
    packed_micro_batches,
    packing_width,
    padding_fraction,
    samples_from_trees,
    split_for_optimizer_steps,
)
from selfcest.tree import CloneTree, Node, Segment, Spawn


def scored_tree(task_index: int, sample: int, reward: float) -> CloneTree:
    """A root that spawns two clones; clone 0.1 failed before sampling anything.

    root: prompt [1, 2] | sampled [3, 4] | return [5, 6, 7] | sampled [8]
    0.0:  prompt [20]   | sampled [21, 22, 23] | notice [24] | sampled [25]
    0.1:  prompt [30]   (error, no tokens)
    """
    tree = CloneTree(task_id=f"t{task_index}", task_index=task_index, sample_index=sample,
                     weight_version=7, reward=reward)
    root = tree.add(Node(
        id="0", parent_id=None, depth=0, objective=None, prompt_ids=[1, 2], weight_version=7,
        segments=[
            Segment("sampled", [3, 4], [-0.3, -0.4]),
            Segment("return", [5, 6, 7]),
            Segment("sampled", [8], [-0.8]),
        ],
        finish_reason="eos",
    ))
    root.spawns.append(Spawn(segment_index=0, child_ids=["0.0", "0.1"]))
    tree.add(Node(
        id="0.0", parent_id="0", depth=1, objective="a", prompt_ids=[20], weight_version=7,
        segments=[
            Segment("sampled", [21, 22, 23], [-2.1, -2.2, -2.3]),
            Segment("notice", [24]),
            Segment("sampled", [25], [-2.5]),
        ],
        finish_reason="eos",
    ))
    tree.add(Node(id="0.1", parent_id="0", depth=1, objective="b", prompt_ids=[30],
                  finish_reason="error"))
    return tree


def test_samples_have_the_full_context_and_a_mask_exactly_on_sampled_tokens():
    trees = [scored_tree(0, 0, 1.0), scored_tree(0, 1, 0.0)]
    advantages = compute_advantages(trees, CreditConfig())
    samples = samples_from_trees(trees, advantages)
    assert [(s.tree_id, s.node_id) for s in samples] == [(0, "0"), (0, "0.0"), (1, "0"), (1, "0.0")]
    root, clone = samples[0], samples[1]
    assert root.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert root.loss_mask == [0, 0, 1, 1, 0, 0, 0, 1]
    assert root.old_logprobs == [0.0, 0.0, -0.3, -0.4, 0.0, 0.0, 0.0, -0.8]
    assert clone.input_ids == [20, 21, 22, 23, 24, 25]
    assert clone.loss_mask == [0, 1, 1, 1, 0, 1]
    assert clone.old_logprobs == [0.0, -2.1, -2.2, -2.3, 0.0, -2.5]
    assert root.advantage == 0.5 and clone.advantage == 0.5 and samples[2].advantage == -0.5
    assert root.weight_version == 7 and root.num_trainable == 3
    # The root's first sampled token is its decision whether to delegate; clones make none.
    assert root.decision_at == 2 and clone.decision_at is None
    # mask 1 exactly where the token came from a sampled segment
    for sample, tree in zip(samples, [trees[0], trees[0], trees[1], trees[1]]):
        node = tree.nodes[sample.node_id]
        assert sum(sample.loss_mask) == node.generated_tokens


def test_a_root_whose_turn_began_prefilled_made_no_decision():
    tree = scored_tree(0, 0, 1.0)
    tree.root.segments.insert(0, Segment("prefill", [9]))  # the engine wrote its first token
    advantages = Advantages(per_tree=[{n: 1.0 for n in tree.nodes}], keep=[True], metrics={})
    root = samples_from_trees([tree], advantages)[0]
    assert root.node_id == "0" and root.decision_at is None
    batch = collate([root], [1.0])
    assert batch.decision_mask.sum() == 0


def test_collate_marks_each_decision_where_its_sample_lies():
    trees = [scored_tree(0, 0, 1.0), scored_tree(0, 1, 0.0)]
    samples = samples_from_trees(trees, compute_advantages(trees, CreditConfig()))
    for pack_width in (None, 32):
        batch = collate(samples, [1.0] * len(samples), pack_width=pack_width)
        marked = batch.decision_mask.nonzero().tolist()
        expected = [[row, start + s.decision_at] for s, (row, start, _) in zip(samples, batch.spans)
                    if s.decision_at is not None]
        assert marked == expected and len(marked) == 2


def test_dropped_trees_give_no_samples():
    trees = [scored_tree(0, 0, 1.0), scored_tree(1, 0, 0.3)]
    advantages = Advantages(per_tree=[{"0": 1.0, "0.0": 1.0, "0.1": 1.0}, {}],
                            keep=[True, False], metrics={})
    assert {s.tree_id for s in samples_from_trees(trees, advantages)} == {0}
    with pytest.raises(ValueError, match="2 trees but advantages for 1"):
        samples_from_trees(trees, Advantages(per_tree=[{}], keep=[False], metrics={}))


def test_sample_lists_must_align():
    with pytest.raises(ValueError, match="one entry per token"):
        TrainingSample([1, 2], [0, 1], [0.0], 1.0, 0, "0", None)


# ------------------------------------------------------------------ micro-batches


def test_micro_batches_hand_example():
    # sorted: 8 (#2), 5 (#0), 3 (#1), 2 (#3); budget 10, so 8 is alone and 5+3+2 never fit
    # (3 x 5 = 15). Cost = padded tokens + overhead per micro-batch:
    #   [8][5,3][2]: 8 + 10 + 2 = 20 padded, 3 passes
    #   [8][5][3,2]: 8 + 5 + 6  = 19 padded, 3 passes
    #   [8][5][3][2]: 8 + 5 + 3 + 2 = 18 padded, 4 passes
    lengths = [5, 3, 8, 2]
    # overhead 1: 19 + 3 = 22 ties 18 + 4 = 22 -> fewer passes wins
    assert make_micro_batches(lengths, 10, pass_overhead_tokens=1) == [[2], [0], [1, 3]]
    # no overhead: padding is all that counts -> one sample per micro-batch
    assert make_micro_batches(lengths, 10, pass_overhead_tokens=0) == [[2], [0], [1], [3]]
    # padded 8 + 5 + 6 = 19, real 18 -> 1/19 padding
    assert padding_fraction(lengths, [[2], [0], [1, 3]]) == pytest.approx(1 / 19)


def test_overhead_of_a_budget_gives_the_fewest_micro_batches():
    # lengths 6, 5, 4, 3 (x2 rows each fit 12); fewest = 2 micro-batches
    lengths = [6, 5, 4, 3]
    batches = make_micro_batches(lengths, 12, pass_overhead_tokens=12)
    assert batches == [[0, 1], [2, 3]]  # the only 2-micro-batch cut (3 x 5 > 12)
    assert make_micro_batches(lengths, 12, pass_overhead_tokens=0) == [[0], [1], [2], [3]]


def test_oversize_samples_go_alone_or_raise():
    assert make_micro_batches([12, 4, 4], 10) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="sample 0 has 12 tokens"):
        make_micro_batches([12, 4, 4], 10, oversize="raise")


def test_a_shared_prompt_keeps_its_group_in_one_micro_batch():
    # Two prompts of 10 tokens, two rows each (a GRPO step in small); one completion ends
    # early: lengths 30, 30, 30, 22 (rows 0, 1: prompt A; rows 2, 3: prompt B), overhead 4.
    lengths = [30, 30, 30, 22]
    prompts = [(1,) * 10, (1,) * 10, (2,) * 10, (2,) * 10]
    # Rows run whole: [all] 120 + 4 = 124 against [30, 30, 30][22] 90 + 22 + 8 = 120.
    assert make_micro_batches(lengths, 1000, pass_overhead_tokens=4) == [[0, 1, 2], [3]]
    # Prompts run once (9 shared columns): [all] 120 - 2 x 9 + 4 = 106 against
    # (90 - 1 x 9) + 22 + 8 = 111: the short row stays with its group.
    assert make_micro_batches(lengths, 1000, pass_overhead_tokens=4,
                              prompts=prompts) == [[0, 1, 2, 3]]
    # Prompts that all differ share nothing: the cut is the one without prompts.
    distinct = [(k,) * 10 for k in range(4)]
    assert make_micro_batches(lengths, 1000, pass_overhead_tokens=4,
                              prompts=distinct) == [[0, 1, 2], [3]]


def computed_tokens(run: list[int], lengths: list[int], prompts: list[tuple[int, ...]]) -> int:
    """What the update computes for one micro-batch whose prompts run once each: the rows
    padded to the longest, less the shared columns of every row that repeats a prompt."""
    shared = max(min(len(prompts[i]) for i in run) - 1, 0)
    return (len(run) * max(lengths[i] for i in run) - (len(run) - len(set(prompts[i] for i in run)))
            * shared)


def test_the_prompt_aware_cut_is_the_cheapest_cut_of_the_length_order():
    """Against every cut of the length-sorted samples into runs, on random GRPO-like steps."""
    rng = random.Random(2)
    for _ in range(60):
        groups = rng.randint(1, 4)
        prompts, lengths = [], []
        for group in range(groups):
            prompt = (group,) * rng.randint(1, 12)
            for _ in range(rng.randint(1, 3)):
                prompts.append(prompt)
                lengths.append(len(prompt) + rng.randint(1, 20))
        budget, overhead = rng.randint(40, 200), rng.randint(0, 20)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        fitting = [i for i in order if lengths[i] <= budget]
        best = None
        for mask in range(2 ** max(len(fitting) - 1, 0)):
            runs, run = [], [fitting[0]] if fitting else []
            for k in range(1, len(fitting)):
                if mask >> (k - 1) & 1:
                    runs.append(run)
                    run = []
                run.append(fitting[k])
            runs += [run] if run else []
            if any(len(r) * max(lengths[i] for i in r) > budget for r in runs):
                continue
            cost = (sum(computed_tokens(r, lengths, prompts) + overhead for r in runs), len(runs))
            best = cost if best is None else min(best, cost)
        batches = make_micro_batches(lengths, budget, pass_overhead_tokens=overhead,
                                     prompts=prompts)
        cut = [b for b in batches if lengths[b[0]] <= budget]
        assert (sum(computed_tokens(r, lengths, prompts) + overhead for r in cut),
                len(cut)) == (best or (0, 0))


def realistic_lengths(seed: int = 0) -> list[int]:
    """A step of 8 prompts x 4 trees: long root contexts, many shorter clone contexts."""
    rng = random.Random(seed)
    roots = [rng.randint(1200, 4000) for _ in range(32)]
    clones = [rng.randint(150, 1400) for _ in range(32 * rng.randint(3, 6))]
    return roots + clones


@pytest.mark.parametrize("budget", [4096, 8192, 16384, 32768])
def test_padding_never_exceeds_the_budget_and_stays_small(budget):
    lengths = realistic_lengths()
    batches = make_micro_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= budget
    assert padding_fraction(lengths, batches) < 0.05
    # For scale: padding every row to the longest, as the reference does, wastes most of it.
    assert padding_fraction(lengths, [list(range(len(lengths)))]) > 0.5


def test_budget_holds_on_random_lengths():
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(300, 2000)
        for batch in make_micro_batches(lengths, budget):
            assert len(batch) * max(lengths[i] for i in batch) <= budget


# ------------------------------------------------------------------ optimizer steps


def test_optimizer_step_count_is_fixed_and_balanced_by_tokens():
    tokens = [10, 9, 8, 7, 6, 5]
    micro_batches = [[0], [1], [2], [3], [4], [5]]
    steps = split_for_optimizer_steps(micro_batches, 2, tokens)
    # largest first, each to the least-loaded step (ties: the first):
    #   10 -> s0 (10); 9 -> s1 (9); 8 -> s1 (17); 7 -> s0 (17); 6 -> s0 (23); 5 -> s1 (22)
    assert steps == [[[0], [3], [4]], [[1], [2], [5]]]


def test_step_count_does_not_depend_on_the_clone_count():
    for n_samples in (4, 40, 400):
        lengths = [100] * n_samples
        batches = make_micro_batches(lengths, 1000)
        steps = split_for_optimizer_steps(batches, 4, lengths)
        assert len(steps) == 4 and all(steps)
        assert sorted(i for s in steps for b in s for i in b) == list(range(n_samples))


def test_too_few_micro_batches_are_halved_and_only_missing_samples_leave_steps_empty():
    # one micro-batch of 4 rows, 3 steps: halved twice into single-digit groups
    steps = split_for_optimizer_steps([[0, 1, 2, 3]], 3, [40, 30, 20, 10])
    assert all(steps)
    assert sorted(i for s in steps for b in s for i in b) == [0, 1, 2, 3]
    # 2 samples cannot fill 3 steps
    steps = split_for_optimizer_steps([[0, 1]], 3, [5, 5])
    assert [len(s) for s in steps] == [1, 1, 0]
    with pytest.raises(ValueError, match="num_steps"):
        split_for_optimizer_steps([[0]], 0, [1])


# ------------------------------------------------------------------ collation


def test_collate_right_pads_and_weights_only_sampled_tokens():
    trees = [scored_tree(0, 0, 1.0), scored_tree(0, 1, 0.0)]
    samples = samples_from_trees(trees, compute_advantages(trees, CreditConfig()))
    batch = collate(samples[:2], [0.25, 0.5], pad_token_id=-1)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25, -1, -1]]
    assert batch.attention_mask.tolist() == [[1] * 8, [1] * 6 + [0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 1], [0, 1, 1, 1, 0, 1, 0, 0]]
    assert batch.token_weights.tolist() == [
        [0, 0, 0.25, 0.25, 0, 0, 0, 0.25], [0, 0.5, 0.5, 0.5, 0, 0.5, 0, 0]]
    assert batch.advantages.tolist() == [[0.5] * 8, [0.5] * 6 + [0, 0]]
    assert batch.spans == [(0, 0, 8), (1, 0, 6)]
    assert batch.old_logprobs[1, 5].item() == pytest.approx(-2.5)
    assert batch.to("cpu").input_ids.dtype == torch.long


def test_packed_collate_puts_samples_side_by_side_with_their_own_positions():
    trees = [scored_tree(0, 0, 1.0), scored_tree(0, 1, 0.0)]
    samples = samples_from_trees(trees, compute_advantages(trees, CreditConfig()))
    lengths = [s.length for s in samples]
    batch = collate(samples, [0.25] * len(samples), pad_token_id=-1, pack_width=16)
    assert batch.attention_mask is None  # transformers separates samples by their positions
    assert lengths == [8, 6, 8, 6] and pack_rows(lengths, 16) == [[0, 1], [2, 3]]
    assert pack_rows([8, 6, 8, 6], 13) == [[0], [1], [2], [3]]
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24, 25]
    assert batch.position_ids[0].tolist() == list(range(8)) + list(range(6))
    assert batch.spans == [(0, 0, 8), (0, 8, 6), (1, 0, 8), (1, 8, 6)]
    # A row's padding counts from 0, as a sample of its own that no real token sees.
    short = collate(samples[1:], [0.25] * 3, pad_token_id=-1, pack_width=16)
    assert short.position_ids.tolist() == [list(range(6)) + list(range(8)), list(range(6))
                                           + list(range(8))]
    assert short.input_ids[1, 6:].tolist() == [-1] * 8
    for sample, values in zip(samples, batch.per_sample(batch.old_logprobs)):
        assert values.tolist() == pytest.approx(sample.old_logprobs)
    for sample, values in zip(samples, batch.per_sample(batch.advantages)):
        assert values.tolist() == [sample.advantage] * sample.length
    placed = batch.place(batch.per_sample(batch.old_logprobs))
    assert torch.equal(placed, batch.old_logprobs)


@pytest.mark.parametrize("budget", [4096, 8192, 16384])
def test_packed_micro_batches_fit_the_budget_and_pad_little(budget):
    lengths = realistic_lengths()
    width = packing_width(lengths, budget)
    batches = packed_micro_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        rows = pack_rows([lengths[i] for i in batch], width)
        assert len(rows) * width <= budget
    packed = padding_fraction(lengths, batches, width)
    unpacked = padding_fraction(lengths, make_micro_batches(lengths, budget))
    assert packed < 0.03 and packed < unpacked


def test_packing_fills_rows_that_one_sample_per_row_leaves_half_empty():
    # One long root and many short clones: a row per sample pads the clones' micro-batches
    # little, but whatever is cut next to the root pads a lot; packed rows do not.
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(300, 2000)
        width = packing_width(lengths, budget)
        batches = packed_micro_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for batch in batches:
            assert len(pack_rows([lengths[i] for i in batch], width)) * width <= budget
    assert packing_width([5, 900, 40], 512) == 40  # the longest that fits; 900 goes alone
    assert packed_micro_batches([5, 900, 40], 512)[0] == [1]


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "tree_mean"])
def test_step_loss_is_the_same_for_any_token_budget(mode):
    """Sampling -> micro-batches -> loss: the step's loss does not depend on the split."""
    trees = [scored_tree(0, i, r) for i, r in enumerate([1.0, 0.0, 0.4])]
    samples = samples_from_trees(trees, compute_advantages(trees, CreditConfig()))
    weights = aggregation_weights(
        [s.num_trainable for s in samples], [s.tree_id for s in samples], mode)
    generator = torch.Generator().manual_seed(0)
    # a fixed "current policy" logprob per (sample, position), shared by every split
    current = [torch.randn(s.length, generator=generator) * 0.1 - 1 for s in samples]
    totals = []
    lengths = [s.length for s in samples]
    for budget, packed in ((8, False), (16, False), (64, False), (16, True), (64, True)):
        width = packing_width(lengths, budget) if packed else None
        split = (packed_micro_batches(lengths, budget) if packed
                 else make_micro_batches(lengths, budget))
        total = 0.0
        for micro_batch in split:
            batch = collate([samples[i] for i in micro_batch], [weights[i] for i in micro_batch],
                            pack_width=width)
            logprobs = batch.place([current[i] for i in micro_batch])
            loss, _ = per_token_loss(logprobs, batch.old_logprobs, batch.advantages,
                                     batch.loss_mask, LossConfig())
            total += (loss * batch.token_weights).sum().item()
        totals.append(total)
    assert totals == pytest.approx([totals[0]] * 5, rel=1e-6)
    assert totals[0] != 0.0
