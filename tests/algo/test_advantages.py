"""Advantages and credit: every formula against hand-computed values, and every gate's count."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from selfcest.algo.advantages import CreditConfig, compute_advantages
from selfcest.algo.credit import reward_ratio
from selfcest.tree import CloneTree, Node, Segment, Spawn


def make_tree(
    task_index: int,
    reward: float | None,
    spawns: dict[str, list[list[str]]] | None = None,
    *,
    sample: int = 0,
    node_rewards: dict[str, float] | None = None,
    info: dict | None = None,
    finish: dict[str, str] | None = None,
) -> CloneTree:
    """A tree whose node ``p`` made one spawn call per list in ``spawns[p]``."""
    tree = CloneTree(task_id=f"t{task_index}", task_index=task_index, sample_index=sample,
                     reward=reward, node_rewards=node_rewards, info=info or {})

    def add(node_id: str, parent: str | None, depth: int) -> None:
        node = tree.add(Node(
            id=node_id, parent_id=parent, depth=depth,
            objective=None if parent is None else "sub-task", prompt_ids=[1, 2],
            segments=[Segment("sampled", [3, 4], [-0.1, -0.2])],
            finish_reason=(finish or {}).get(node_id, "eos"),
        ))
        for group in (spawns or {}).get(node_id, []):
            node.spawns.append(Spawn(segment_index=0, child_ids=list(group)))
            for child in group:
                add(child, node_id, depth + 1)

    add("0", None, 0)
    return tree


TWO_CLONES = {"0": [["0.0", "0.1"]]}


# ------------------------------------------------------------------ root advantage, groups


def test_broadcast_gives_every_node_the_group_relative_root_advantage():
    trees = [
        make_tree(0, 1.0, TWO_CLONES, sample=0),
        make_tree(0, 0.0, sample=1),
        make_tree(0, 0.5, sample=2),
    ]
    adv = compute_advantages(trees, CreditConfig(strategy="broadcast"))
    # mean = (1 + 0 + 0.5) / 3 = 0.5  ->  A = 0.5, -0.5, 0
    assert adv.per_tree[0] == {"0": 0.5, "0.0": 0.5, "0.1": 0.5}
    assert adv.per_tree[1] == {"0": -0.5}
    assert adv.per_tree[2] == {"0": 0.0}
    assert adv.keep == [True, True, True]
    assert adv.metrics["adv/root_mean"] == 0.0
    assert adv.metrics["adv/root_max"] == 0.5 and adv.metrics["adv/root_min"] == -0.5


def test_std_normalisation_divides_by_unbiased_group_std_plus_eps():
    trees = [make_tree(0, r, sample=i) for i, r in enumerate([1.0, 0.0, 0.5])]
    adv = compute_advantages(trees, CreditConfig(std_normalize=True, eps=1e-6))
    # unbiased std = sqrt((0.5^2 + 0.5^2 + 0^2) / 2) = 0.5  ->  A = 0.5 / 0.500001
    assert adv.per_tree[0]["0"] == pytest.approx(0.5 / 0.500001, rel=1e-12)
    assert adv.per_tree[1]["0"] == pytest.approx(-0.5 / 0.500001, rel=1e-12)
    assert adv.per_tree[2]["0"] == 0.0


def test_groups_are_the_trees_of_one_task_index():
    trees = [make_tree(0, 1.0), make_tree(1, 2.0), make_tree(0, 0.0, sample=1),
             make_tree(1, 4.0, sample=1)]
    adv = compute_advantages(trees, CreditConfig())
    # task 0: mean 0.5 -> +0.5, -0.5; task 1: mean 3 -> -1, +1
    assert [a["0"] for a in adv.per_tree] == [0.5, -1.0, -0.5, 1.0]


# ------------------------------------------------------------------ gates


def test_zero_variance_groups_are_dropped_and_counted():
    trees = [
        make_tree(0, 1.0, TWO_CLONES), make_tree(0, 1.0, sample=1),  # tied
        make_tree(1, 0.0), make_tree(1, 1.0, sample=1),  # informative
        make_tree(2, 0.7),  # a one-tree group has zero variance too
        make_tree(3, 0.3), make_tree(3, 0.1 + 0.2, sample=1),  # tied up to float noise
    ]
    adv = compute_advantages(trees, CreditConfig())
    assert adv.keep == [False, False, True, True, False, False, False]
    assert adv.per_tree[0] == {}
    assert adv.metrics["gate/zero_variance_groups"] == 3
    assert adv.metrics["gate/zero_variance_trees"] == 5
    assert adv.metrics["gate/kept_trees"] == 2

    kept = compute_advantages(trees, CreditConfig(drop_zero_variance_groups=False))
    assert all(kept.keep)
    assert kept.per_tree[0] == {"0": 0.0, "0.0": 0.0, "0.1": 0.0}
    assert kept.per_tree[4] == {"0": 0.0}  # singleton group: advantage 0
    assert kept.metrics["gate/zero_variance_groups"] == 0
    assert kept.metrics["credit/zero_advantage_clone_frac"] == 1.0


def test_error_trees_leave_the_group_before_its_statistics():
    trees = [
        make_tree(0, None, finish={"0": "error"}),  # an unscored error tree is fine
        make_tree(0, 0.0, sample=1),
        make_tree(0, 0.5, sample=2),
    ]
    adv = compute_advantages(trees, CreditConfig())
    # group without the error tree: mean 0.25 -> -0.25, +0.25
    assert adv.keep == [False, True, True]
    assert adv.per_tree[1]["0"] == -0.25 and adv.per_tree[2]["0"] == 0.25
    assert adv.metrics["gate/error_trees"] == 1

    trees[0].reward = 1.0
    kept = compute_advantages(trees, CreditConfig(drop_error_trees=False))
    assert kept.keep == [True, True, True] and kept.metrics["gate/error_trees"] == 0
    assert kept.per_tree[0]["0"] == 0.5  # mean 0.5


def test_truncated_trees_are_dropped_only_when_configured():
    trees = [
        make_tree(0, 1.0, TWO_CLONES, finish={"0.1": "budget"}),  # a clone ran out of budget
        make_tree(0, 0.0, sample=1),
        make_tree(0, 0.5, sample=2),
    ]
    default = compute_advantages(trees, CreditConfig())
    assert default.keep == [True, True, True] and default.metrics["gate/truncated_trees"] == 0

    adv = compute_advantages(trees, CreditConfig(drop_truncated_trees=True))
    assert adv.keep == [False, True, True]
    assert adv.metrics["gate/truncated_trees"] == 1
    assert adv.per_tree[2]["0"] == 0.25  # mean of (0, 0.5) = 0.25


def test_malformed_clones_get_zero_advantage_and_are_counted():
    trees = [
        make_tree(0, 1.0, {"0": [["0.0", "0.1", "0.2"]]}, info={"malformed_nodes": ["0.1"]}),
        make_tree(0, 0.0, sample=1),
    ]
    adv = compute_advantages(trees, CreditConfig())
    assert adv.per_tree[0] == {"0": 0.5, "0.0": 0.5, "0.1": 0.0, "0.2": 0.5}
    assert adv.metrics["gate/malformed_clones"] == 1
    assert adv.metrics["credit/zero_advantage_clone_frac"] == pytest.approx(1 / 3)

    off = compute_advantages(trees, CreditConfig(zero_malformed_clones=False))
    assert off.per_tree[0]["0.1"] == 0.5 and off.metrics["gate/malformed_clones"] == 0


def test_malformed_ids_that_are_not_clones_are_refused():
    trees = [make_tree(0, 1.0, TWO_CLONES, info={"malformed_nodes": ["0.7"]}),
             make_tree(0, 0.0, sample=1)]
    with pytest.raises(ValueError, match=r"malformed_nodes.*0\.7"):
        compute_advantages(trees, CreditConfig())


def test_missing_reward_names_the_tree():
    trees = [make_tree(0, 1.0), make_tree(0, None, sample=3)]
    with pytest.raises(ValueError, match="t0#3"):
        compute_advantages(trees, CreditConfig())


# ------------------------------------------------------------------ ratio


def test_ratio_scales_the_root_advantage_by_the_clipped_magnitude_ratio():
    spawns = {"0": [["0.0", "0.1", "0.2"]]}
    trees = [
        make_tree(0, 1.0, spawns, node_rewards={"0.0": 0.4, "0.1": 3.0}),  # 0.2: no reward
        make_tree(0, 0.0, TWO_CLONES, sample=1, node_rewards={"0.0": 0.0, "0.1": 0.0}),
    ]
    config = CreditConfig(strategy="ratio", ratio_clip=1.5, ratio_smoothing=0.1)
    adv = compute_advantages(trees, config)
    # A_root = 1 - 0.5 = 0.5 and 0 - 0.5 = -0.5
    # 0.0: w = (0.4 + 0.1) / (1 + 0.1) = 0.4545..  -> 0.5 * 0.4545.. = 0.22727..
    # 0.1: w = (3 + 0.1) / 1.1 = 2.818 -> clipped to 1.5 -> 0.75
    # 0.2: no node reward, R_c = R_root -> w = 1 -> 0.5
    assert adv.per_tree[0]["0"] == 0.5
    assert adv.per_tree[0]["0.0"] == pytest.approx(0.5 * 0.5 / 1.1)
    assert adv.per_tree[0]["0.1"] == pytest.approx(0.75)
    assert adv.per_tree[0]["0.2"] == pytest.approx(0.5)
    # Failed root (R = 0) with reward-0 clones: w = (0 + 0.1) / (0 + 0.1) = 1, so the clones
    # share the negative advantage (the paper code gives them 0: they never learn).
    assert adv.per_tree[1] == {"0": -0.5, "0.0": -0.5, "0.1": -0.5}
    assert adv.metrics["credit/node_reward_fallback_frac"] == pytest.approx(1 / 5)


def test_ratio_never_flips_the_sign_when_penalties_push_the_root_reward_negative():
    # Root score 0.02 minus one JSON-repair penalty 0.05 -> R_root = -0.03; clone reward 0.02.
    trees = [
        make_tree(0, -0.03, TWO_CLONES, node_rewards={"0.0": 0.02, "0.1": -0.03}),
        make_tree(0, 0.97, sample=1),
    ]
    adv = compute_advantages(trees, CreditConfig(strategy="ratio"))
    # mean = 0.47 -> A_root = -0.5
    # paper: -0.5 * (0.02 / -0.03) = +0.333 (pushed against the tree's outcome)
    # here:  w = (0.02 + 0.1) / (0.03 + 0.1) = 0.12 / 0.13 -> -0.5 * 0.923 = -0.4615
    assert adv.per_tree[0]["0"] == pytest.approx(-0.5)
    assert adv.per_tree[0]["0.0"] == pytest.approx(-0.5 * 0.12 / 0.13)
    assert adv.per_tree[0]["0.1"] == pytest.approx(-0.5)  # |R_c| = |R_root| -> w = 1


def test_ratio_is_defined_and_continuous_at_a_zero_root_reward():
    c, d = 1.5, 0.1
    # paper: 0 / 1e-8 = 0 at R_root = 0, but (-0.001) / (-0.001) = 1 just beside it
    assert reward_ratio(0.0, 0.0, c, d) == 1.0
    assert reward_ratio(-0.001, -0.001, c, d) == 1.0
    # paper: 0.02 / 1e-8 -> clipped to 1.5; here (0.02 + 0.1) / (0 + 0.1) = 1.2
    assert reward_ratio(0.02, 0.0, c, d) == pytest.approx(1.2)
    # continuity: a root reward of 1e-9 (either sign) barely moves it
    assert reward_ratio(0.02, 1e-9, c, d) == pytest.approx(1.2, abs=1e-7)
    assert reward_ratio(0.02, -1e-9, c, d) == pytest.approx(1.2, abs=1e-7)
    assert all(reward_ratio(r, -0.05, c, d) >= 0 for r in (-1.0, -0.01, 0.0, 0.3))


def test_ratio_approaches_the_paper_ratio_where_that_is_well_defined():
    # math reward: correct root s = 1, well-formed clone s / 2.5 = 0.4 -> paper ratio 0.4
    assert reward_ratio(0.4, 1.0, 1.5, 1e-9) == pytest.approx(0.4, abs=1e-8)
    assert reward_ratio(3.0, 1.0, 1.5, 1e-9) == 1.5  # upper clip as the paper's


# ------------------------------------------------------------------ sibling


def test_sibling_adds_a_leave_one_out_term_among_clones_of_one_spawn_call():
    spawns = {"0": [["0.0", "0.1", "0.2"], ["0.3"]], "0.1": [["0.1.0", "0.1.1"]]}
    rewards = {"0.0": 1.0, "0.1": 0.0, "0.2": 0.5, "0.3": 9.0, "0.1.0": 0.2, "0.1.1": 0.6}
    trees = [make_tree(0, 1.0, spawns, node_rewards=rewards), make_tree(0, 0.0, sample=1)]
    adv = compute_advantages(trees, CreditConfig(strategy="sibling"))
    a = adv.per_tree[0]
    # A_root = 0.5
    # 0.0: baseline (0 + 0.5) / 2 = 0.25 -> 0.5 + (1 - 0.25) = 1.25
    # 0.1: baseline (1 + 0.5) / 2 = 0.75 -> 0.5 + (0 - 0.75) = -0.25
    # 0.2: baseline (1 + 0) / 2 = 0.5   -> 0.5 + 0 = 0.5
    # 0.3: alone in its spawn call      -> 0.5
    # 0.1.0 / 0.1.1: baselines 0.6 / 0.2 -> 0.5 - 0.4 = 0.1, 0.5 + 0.4 = 0.9
    assert a["0"] == 0.5
    assert a["0.0"] == pytest.approx(1.25)
    assert a["0.1"] == pytest.approx(-0.25)
    assert a["0.2"] == pytest.approx(0.5)
    assert a["0.3"] == 0.5
    assert a["0.1.0"] == pytest.approx(0.1) and a["0.1.1"] == pytest.approx(0.9)
    assert adv.metrics["credit/node_reward_fallback_frac"] == 0.0


def test_sibling_terms_are_scaled_by_their_own_spread_when_std_normalising():
    spawns = {"0": [["0.0", "0.1"]]}
    trees = [make_tree(0, 1.0, spawns, node_rewards={"0.0": 1.0, "0.1": 0.0}),
             make_tree(0, 0.0, spawns, sample=1, node_rewards={"0.0": 0.5, "0.1": 0.5})]
    adv = compute_advantages(trees, CreditConfig(strategy="sibling", std_normalize=True))
    s_root = math.sqrt(0.5) + 1e-6  # unbiased std of the root rewards (1, 0)
    # raw sibling terms: +1, -1 (tree 0) and 0, 0 (tree 1): rms = sqrt(2 / 4)
    s_clone = math.sqrt(0.5) + 1e-6
    assert adv.per_tree[0]["0.0"] == pytest.approx(0.5 / s_root + 1 / s_clone)
    assert adv.per_tree[0]["0.1"] == pytest.approx(0.5 / s_root - 1 / s_clone)
    assert adv.per_tree[1]["0.0"] == pytest.approx(-0.5 / s_root)


def test_clone_terms_of_near_tied_trees_stay_unit_sized():
    """The audit's case: two trees whose rewards differ only by a 0.001 token cost, clones
    whose rewards differ by 1. Divided by the root rewards' spread, the clone terms were
    ~+1,410 for both trees' winning clones."""
    spawns = {"0": [["0.0", "0.1"]]}
    clones = {"0.0": 1.0, "0.1": 0.0}
    trees = [make_tree(0, 1.0, spawns, node_rewards=clones),
             make_tree(0, 0.999, spawns, sample=1, node_rewards=clones)]
    adv = compute_advantages(trees, CreditConfig(strategy="sibling", std_normalize=True))
    s_root = statistics.stdev([1.0, 0.999]) + 1e-6
    for i, a_root in ((0, 0.0005 / s_root), (1, -0.0005 / s_root)):
        assert adv.per_tree[i]["0"] == pytest.approx(a_root)  # about +-0.707
        # raw terms +1, -1 in both trees: rms 1, so the clone terms are +-1
        assert adv.per_tree[i]["0.0"] == pytest.approx(a_root + 1 / (1 + 1e-6))
        assert adv.per_tree[i]["0.1"] == pytest.approx(a_root - 1 / (1 + 1e-6))

    cf = {"0.0": 0.0, "0.1": 1.0}  # the tree needed clone 0.0's answer, not 0.1's
    trees = [make_tree(0, 1.0, spawns, info={"counterfactual": dict(cf)}),
             make_tree(0, 0.999, spawns, sample=1,
                       info={"counterfactual": {"0.0": 0.0, "0.1": 0.999}})]
    adv = compute_advantages(trees, CreditConfig(strategy="counterfactual", std_normalize=True))
    # raw differences 1, 0, 0.999, 0: rms = sqrt((1 + 0.999^2) / 4)
    rms = math.sqrt((1 + 0.999**2) / 4) + 1e-6
    assert adv.per_tree[0]["0.0"] == pytest.approx(1 / rms)
    assert adv.per_tree[0]["0.1"] == 0.0
    assert adv.per_tree[1]["0.0"] == pytest.approx(0.999 / rms)


def test_sibling_without_node_rewards_falls_back_to_broadcast():
    trees = [make_tree(0, 1.0, TWO_CLONES), make_tree(0, 0.0, sample=1)]
    adv = compute_advantages(trees, CreditConfig(strategy="sibling"))
    assert adv.per_tree[0] == {"0": 0.5, "0.0": 0.5, "0.1": 0.5}
    assert adv.metrics["credit/node_reward_fallback_frac"] == 1.0


# ------------------------------------------------------------------ counterfactual


def test_counterfactual_credits_each_clone_with_its_reward_difference():
    spawns = {"0": [["0.0", "0.1", "0.2"]]}
    cf = {"0.0": 0.2, "0.1": 1.0}  # 0.2 is malformed: zeroed, so its re-run may be skipped
    trees = [
        make_tree(0, 1.0, spawns, info={"counterfactual": cf, "malformed_nodes": ["0.2"]}),
        make_tree(0, 0.0, sample=1),
    ]
    adv = compute_advantages(trees, CreditConfig(strategy="counterfactual"))
    # 0.0: 1.0 - 0.2 = 0.8 (the tree needed it); 0.1: 1.0 - 1.0 = 0 (it did not)
    assert adv.per_tree[0] == {"0": 0.5, "0.0": pytest.approx(0.8), "0.1": 0.0, "0.2": 0.0}

    scaled = compute_advantages(
        trees, CreditConfig(strategy="counterfactual", std_normalize=True))
    # the group's raw differences are 0.8 and 0 (0.2 skipped): rms = 0.8 / sqrt(2)
    assert scaled.per_tree[0]["0.0"] == pytest.approx(0.8 / (0.8 / math.sqrt(2) + 1e-6))
    assert scaled.per_tree[0]["0.1"] == 0.0


def test_counterfactual_without_its_input_is_a_clear_error():
    trees = [make_tree(0, 1.0, TWO_CLONES), make_tree(0, 0.0, sample=1)]
    with pytest.raises(ValueError, match=r"counterfactual.*t0#0"):
        compute_advantages(trees, CreditConfig(strategy="counterfactual"))

    trees[0].info["counterfactual"] = {"0.0": 0.1}
    with pytest.raises(ValueError, match=r"missing \['0.1'\]"):
        compute_advantages(trees, CreditConfig(strategy="counterfactual"))

    # A tree without clones needs no re-runs.
    alone = [make_tree(0, 1.0), make_tree(0, 0.0, sample=1)]
    assert compute_advantages(alone, CreditConfig(strategy="counterfactual")).keep == [True, True]


# ------------------------------------------------------------------ bounds


def random_group(rng: random.Random, task_index: int) -> list:
    """Trees of one prompt with rewards drawn to include exact ties, near-ties (1e-7, 1e-12,
    one cost penalty of 1e-3) and wide spreads, random spawn calls, node rewards and
    counterfactual values."""
    base = rng.choice([0.0, 1.0, rng.uniform(-3, 3)])
    jitter = rng.choice([0.0, 1e-12, 1e-7, 1e-3, 1.0, 100.0])
    size = rng.randint(1, 32)
    trees = []
    for sample in range(size):
        spawns = {"0": [[f"0.{k}" for k in range(rng.randint(1, 6))]
                        for _ in range(rng.randint(0, 2))]}
        ids = [c for call in spawns["0"] for c in call]
        ids = [f"0.{n}" for n in range(len(ids))]  # unique ids across calls
        calls, at = [], 0
        for call in spawns["0"]:
            calls.append(ids[at: at + len(call)])
            at += len(call)
        spawns = {"0": calls}
        reward = base + jitter * rng.choice([0, 1, -1, rng.random()])
        clone_jitter = rng.choice([0.0, 1e-9, 1.0, 50.0])
        node_rewards = {c: reward + clone_jitter * rng.random() for c in ids}
        cf = {c: reward - rng.choice([0.0, 1e-9, 1.0, 50.0]) * rng.random() for c in ids}
        trees.append(make_tree(task_index, reward, spawns, sample=sample,
                               node_rewards=node_rewards, info={"counterfactual": cf}))
    return trees


@pytest.mark.parametrize("strategy", ["broadcast", "ratio", "sibling", "counterfactual"])
@pytest.mark.parametrize("drop_ties", [True, False])
def test_normalised_advantages_are_bounded_by_the_documented_constant(strategy, drop_ties):
    rng = random.Random(f"{strategy}:{drop_ties}")
    config = CreditConfig(strategy=strategy, std_normalize=True,
                          drop_zero_variance_groups=drop_ties)
    for _ in range(60):
        trees = [t for g in range(rng.randint(1, 4)) for t in random_group(rng, g)]
        adv = compute_advantages(trees, config)
        values = [a for credit in adv.per_tree for a in credit.values()]
        assert all(math.isfinite(a) and abs(a) <= config.max_abs_advantage for a in values)


@pytest.mark.parametrize("strategy", ["broadcast", "ratio", "sibling", "counterfactual"])
def test_unnormalised_advantages_never_exceed_the_reward_spreads_they_compare(strategy):
    rng = random.Random(strategy)
    config = CreditConfig(strategy=strategy, drop_zero_variance_groups=False)
    for _ in range(60):
        trees = random_group(rng, 0)
        adv = compute_advantages(trees, config)
        rewards = [t.reward for t in trees]
        spread = max(rewards) - min(rewards)
        for tree, credit in zip(trees, adv.per_tree):
            assert abs(credit["0"]) <= spread + 1e-9
            node_spread = (max(tree.node_rewards.values(), default=0)
                           - min(tree.node_rewards.values(), default=0))
            cf_spread = max((abs(tree.reward - v) for v in tree.info["counterfactual"].values()),
                            default=0)
            bound = {"broadcast": spread, "ratio": config.ratio_clip * spread,
                     "sibling": spread + node_spread, "counterfactual": cf_spread}[strategy]
            assert all(abs(credit[c.id]) <= bound + 1e-9 for c in tree.clones())


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"strategy": "coma"}, "^strategy "),
        ({"eps": 0.0}, "^eps "),
        ({"ratio_clip": -1.0}, "^ratio_clip "),
        ({"ratio_smoothing": float("nan")}, "^ratio_smoothing "),
        ({"drop_zero_variance_groups": "yes"}, "^drop_zero_variance_groups "),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        CreditConfig(**kwargs)
