import math

import pytest
from reward_tree_builders import node, returned, said, single_turn, tree_of

from selfcest.rewards.cost import (
    MATH_REFERENCE_COST,
    CostConfig,
    SaturatingPenalty,
    SpawnCallPenalty,
    cost_terms,
    shape,
)
from selfcest.tree import Spawn

OFF = dict(root_length=None, clone_length=None, spawn_calls=None)


def test_saturating_penalty_reference_values():
    root = SaturatingPenalty(512, 256, 0.3)
    assert root(0) == 0.0 and root(512) == 0.0
    assert root(768) == pytest.approx(0.189636, abs=1e-6)  # 0.3 (1 - e^-1)
    assert root(1024) == pytest.approx(0.259399, abs=1e-6)  # 0.3 (1 - e^-2)
    assert root(10**6) == pytest.approx(0.3)
    assert SaturatingPenalty(512, 512, 0.2)(1024) == pytest.approx(0.126424, abs=1e-6)
    with pytest.raises(ValueError):
        SaturatingPenalty(512, 0, 0.2)


def test_spawn_call_penalty():
    reference = SpawnCallPenalty()  # max(0, 0.1 calls - 0.2)
    assert [reference(n) for n in range(6)] == pytest.approx([0, 0, 0, 0.1, 0.2, 0.3])
    assert SpawnCallPenalty(cap=0.15)(10) == 0.15
    assert SpawnCallPenalty(per_call=0.05, free_calls=0)(3) == pytest.approx(0.15)


def delegating_tree():
    """Root 768 tokens, three spawn calls (the last rejected), a nested wave under 0.1.

    waves: [0.0: 1024, 0.1: 300] then [0.2: 1536]; and 0.1's own wave [0.1.0: 900].
    """
    root = node(
        "0",
        [said("<spawn>a<sep>b</spawn>", 500), returned("1<sep>2"), said("<spawn>c</spawn>", 200),
         returned("3"), said("<spawn></spawn>", 8), returned("error"), said("Answer: 9", 60)],
        [Spawn(0, ["0.0", "0.1"]), Spawn(2, ["0.2"]), Spawn(4, [], errors=["empty objective"])],
    )
    return tree_of(
        root,
        node("0.0", [said("Answer: 1", 1024)]),
        node("0.1", [said("<spawn>d</spawn>", 100), returned("2"), said("Answer: 2", 200)],
             [Spawn(0, ["0.1.0"])]),
        node("0.1.0", [said("Answer: 2", 900)]),
        node("0.2", [said("Answer: 3", 1536)]),
    )


def test_reference_terms_on_a_tree():
    tree = delegating_tree()
    terms = cost_terms(tree, CostConfig())
    wave1 = 0.2 * (1 - math.exp(-(1024 - 512) / 512))
    wave2 = 0.2 * (1 - math.exp(-(1536 - 512) / 512))
    nested = 0.2 * (1 - math.exp(-(900 - 512) / 512))
    assert terms == pytest.approx({
        "cost/root_length": 0.3 * (1 - math.exp(-(768 - 512) / 256)),
        "cost/clone_length": max(wave1, wave2, nested),  # the worst wave only
        "cost/spawn_calls": 0.1,  # 3 calls, 2 free (the rejected call counts)
    })
    summed = cost_terms(tree, CostConfig(clone_waves="sum"))
    assert summed["cost/clone_length"] == pytest.approx(wave1 + wave2 + nested)


def test_linear_terms_on_a_tree():
    config = CostConfig(**OFF, per_token=1e-4, per_critical_path_token=1e-4, per_clone=0.01)
    terms = cost_terms(delegating_tree(), config)
    # generated: 768 + 1024 + 300 + 900 + 1536 = 4528
    # critical path: 768 + max(1024, 300 + 900) + 1536 = 3504; clones: 4
    assert terms == pytest.approx(
        {"cost/tokens": 0.4528, "cost/critical_path": 0.3504, "cost/clones": 0.04}
    )


def test_processed_tokens_count_clone_prompts_and_returns():
    tree = delegating_tree()
    costs = tree.costs()
    root_prompt = len(tree.root.prompt_ids)
    assert costs.processed_tokens == costs.context_tokens - root_prompt
    assert costs.processed_tokens > costs.generated_tokens  # clone prompts and returns count too
    terms = cost_terms(tree, CostConfig(**OFF, per_processed_token=1e-3))
    assert terms == pytest.approx({"cost/processed_tokens": 1e-3 * costs.processed_tokens})


def test_terms_that_are_off_are_absent_and_a_lone_root_pays_only_its_length():
    assert cost_terms(delegating_tree(), CostConfig(**OFF)) == {}
    terms = cost_terms(single_turn("Answer: 1", tokens=600), CostConfig())
    assert terms["cost/clone_length"] == 0.0 and terms["cost/spawn_calls"] == 0.0
    assert terms["cost/root_length"] == pytest.approx(0.3 * (1 - math.exp(-88 / 256)))


def test_shape_cap_and_floor():
    terms = {"cost/a": 0.4, "cost/b": 0.3}
    assert shape(1.0, terms, CostConfig()) == pytest.approx((0.3, 0.7))
    assert shape(1.0, terms, CostConfig(max_penalty=0.5)) == pytest.approx((0.5, 0.5))
    assert shape(0.0, terms, CostConfig()) == pytest.approx((-0.7, 0.7))  # no floor
    assert shape(0.0, terms, MATH_REFERENCE_COST) == pytest.approx((0.0, 0.5))


def test_config_from_mappings():
    config = CostConfig.from_value(
        {"root_length": {"threshold": 100, "ramp": 50, "maximum": 1.0}, "spawn_calls": None,
         "per_clone": 0.5}
    )
    assert config.root_length == SaturatingPenalty(100, 50, 1.0)
    assert config.spawn_calls is None and config.per_clone == 0.5
    assert CostConfig.from_value(None) is None
    with pytest.raises(ValueError, match="unknown cost fields"):
        CostConfig.from_value({"per_tokens": 1.0})
    with pytest.raises(ValueError, match="clone_waves"):
        CostConfig(clone_waves="mean")
