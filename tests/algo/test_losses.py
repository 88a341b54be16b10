"""Losses: PPO-clip values, clip settings that take effect, dual clip, KL, and aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from selfcest.algo.losses import (
    LossConfig,
    aggregation_weights,
    combine_stats,
    kl_penalty,
    per_token_loss,
    token_choice_entropy,
    token_entropy,
)
from selfcest.modeling import token_logprobs

# Two sequences of three tokens; old logprobs 0, so the ratio r is exp(logprobs).
RATIOS = [1.5, 0.5, 1.0]


def ppo_inputs(ratios=RATIOS, advantages=(1.0, -1.0)):
    logprobs = torch.tensor([[math.log(r) for r in ratios]] * len(advantages), requires_grad=True)
    old = torch.zeros_like(logprobs)
    mask = torch.ones_like(logprobs)
    return logprobs, old, torch.tensor(advantages), mask


def test_ppo_clip_matches_hand_values_and_clipped_tokens_get_no_gradient():
    logprobs, old, adv, mask = ppo_inputs()
    loss, stats = per_token_loss(logprobs, old, adv, mask, LossConfig(clip_low=0.2, clip_high=0.2))
    # A = +1: max(-r, -clip(r, 0.8, 1.2)): r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped high)
    #                                       r=0.5 -> max(-0.5, -0.8) = -0.5;  r=1 -> -1
    # A = -1: max(r, clip(r)):              r=1.5 -> 1.5;  r=0.5 -> max(0.5, 0.8) = 0.8
    #                                       (clipped low);  r=1 -> 1
    expected = torch.tensor([[-1.2, -0.5, -1.0], [1.5, 0.8, 1.0]])
    torch.testing.assert_close(loss, expected)
    assert stats["clip_frac_high"] == pytest.approx(1 / 6)
    assert stats["clip_frac_low"] == pytest.approx(1 / 6)
    assert stats["tokens"] == 6
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0) / 3)

    loss.sum().backward()
    # d/dlogp of -A * r is -A * r, except where the clipped branch is active (0).
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, -1.0], [1.5, 0.0, 1.0]]))


def test_clip_low_and_clip_high_each_take_effect():
    logprobs, old, adv, mask = ppo_inputs()
    base_loss, base = per_token_loss(logprobs, old, adv, mask, LossConfig())
    # clip_high 0.2 -> 0.6: r = 1.5 no longer clipped for A = +1: -1.5 instead of -1.2
    high, stats_high = per_token_loss(logprobs, old, adv, mask, LossConfig(clip_high=0.6))
    assert high[0, 0].item() == pytest.approx(-1.5)
    assert stats_high["clip_frac_high"] == 0.0
    assert stats_high["clip_frac_low"] == base["clip_frac_low"]
    # clip_low 0.2 -> 0.1: floor 0.9, so A = -1, r = 0.5 gives 0.9 instead of 0.8
    low, stats_low = per_token_loss(logprobs, old, adv, mask, LossConfig(clip_low=0.1))
    assert low[1, 1].item() == pytest.approx(0.9)
    # clip_low 0.2 -> 0.6: floor 0.4 below r = 0.5, so that token is no longer clipped
    _, stats_wide = per_token_loss(logprobs, old, adv, mask, LossConfig(clip_low=0.6))
    assert stats_wide["clip_frac_low"] == 0.0
    assert not torch.equal(base_loss, high) and not torch.equal(base_loss, low)


def test_dual_clip_caps_the_loss_of_negative_advantages_only():
    logprobs, old, adv, mask = ppo_inputs(ratios=[5.0, 2.0])
    loss, stats = per_token_loss(logprobs, old, adv, mask, LossConfig(dual_clip=3.0))
    # A = +1: r=5 -> max(-5, -1.2) = -1.2; r=2 -> -1.2  (dual clip does not apply)
    # A = -1: r=5 -> max(5, 1.2) = 5 -> min(5, 3 * 1) = 3; r=2 -> 2 (below the cap)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.2], [3.0, 2.0]]))
    assert stats["dual_clip_frac"] == pytest.approx(1 / 4)
    plain, _ = per_token_loss(logprobs, old, adv, mask, LossConfig())
    assert plain[1, 0].item() == pytest.approx(5.0)


def test_per_token_advantages_equal_broadcast_sequence_advantages():
    logprobs, old, adv, mask = ppo_inputs()
    per_seq, _ = per_token_loss(logprobs, old, adv, mask, LossConfig())
    per_tok, _ = per_token_loss(logprobs, old, adv[:, None].expand(-1, 3), mask, LossConfig())
    torch.testing.assert_close(per_seq, per_tok)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_masked_positions_have_zero_loss_and_zero_gradient_even_with_garbage(estimator):
    logprobs = torch.tensor([[-0.5, float("-inf"), -0.3]], requires_grad=True)
    old = torch.tensor([[-0.4, float("nan"), 50.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.5, 0.0, float("inf")]])
    config = LossConfig(kl_coef=0.1, entropy_coef=0.01, kl_estimator=estimator)
    loss, stats = per_token_loss(logprobs, old, torch.tensor([1.0]), mask, config,
                                 ref_logprobs=ref, entropy=torch.ones(1, 3))
    assert loss[0, 1].item() == 0.0 and loss[0, 2].item() == 0.0
    loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 1].item() == 0.0 and logprobs.grad[0, 2].item() == 0.0
    assert logprobs.grad[0, 0].item() != 0.0
    assert stats["tokens"] == 1 and math.isfinite(stats["ratio_mean"])


def test_kl_k3_and_k2_hand_values_and_clamp():
    logprobs = torch.tensor([-1.0, -2.0, -1.0, 0.0])
    ref = torch.tensor([-2.0, -1.0, -1.0, -30.0])
    k3 = kl_penalty(logprobs, ref, "k3")
    # d = ref - logp: -1 -> e^-1 + 1 - 1 = 0.367879;  1 -> e - 1 - 1 = 0.718282;  0 -> 0
    # d = -30 is clamped to -20: e^-20 + 20 - 1 = 19.0000.. -> clamped to 10
    torch.testing.assert_close(k3, torch.tensor([math.exp(-1), math.e - 2, 0.0, 10.0]))
    # k2 = d^2 / 2: 0.5, 0.5, 0, 450 -> 10
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k2"), torch.tensor([0.5, 0.5, 0.0, 10.0]))


def test_kl_and_entropy_terms_enter_the_loss_with_their_coefficients():
    logprobs = torch.tensor([[-1.0, -2.0]])
    old = logprobs.clone()  # r = 1
    ref = torch.tensor([[-2.0, -1.0]])
    entropy = torch.tensor([[0.5, 2.0]])
    mask = torch.ones(1, 2)
    config = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, stats = per_token_loss(logprobs, old, torch.tensor([2.0]), mask, config,
                                 ref_logprobs=ref, entropy=entropy)
    # -A * r + 0.1 * k3 - 0.01 * H
    expected = torch.tensor([[-2 + 0.1 * math.exp(-1) - 0.005, -2 + 0.1 * (math.e - 2) - 0.02]])
    torch.testing.assert_close(loss, expected)
    assert stats["kl_ref"] == pytest.approx((math.exp(-1) + math.e - 2) / 2)
    assert stats["entropy"] == pytest.approx(1.25)

    with pytest.raises(ValueError, match="ref_logprobs"):
        per_token_loss(logprobs, old, torch.tensor([2.0]), mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        per_token_loss(logprobs, old, torch.tensor([2.0]), mask, LossConfig(entropy_coef=0.1))


def test_truncated_importance_weight_scales_the_policy_term():
    logprobs = torch.tensor([[0.0, 0.0]])
    old = torch.zeros(1, 2)
    behaviour = torch.tensor([[-math.log(3.0), -math.log(1.5)]])  # old/behaviour = 3, 1.5
    loss, stats = per_token_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 2),
                                 LossConfig(max_importance_ratio=2.0),
                                 behaviour_logprobs=behaviour)
    # pg = -1 per token; weights min(3, 2) = 2 and 1.5
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -1.5]]))
    assert stats["importance_truncated_frac"] == 0.5
    assert stats["importance_weight_mean"] == pytest.approx(1.75)


def test_approx_kl_to_old_policy():
    logprobs, old, adv, mask = ppo_inputs(ratios=[2.0], advantages=(1.0,))
    _, stats = per_token_loss(logprobs, old, adv, mask, LossConfig())
    assert stats["approx_kl_old"] == pytest.approx(2.0 - 1 - math.log(2.0))  # r - 1 - log r


def test_token_logprobs_and_entropy_are_input_aligned():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    lp = token_logprobs(logits, ids)
    assert lp.shape == (2, 4) and (lp[:, 0] == 0).all()
    # token t is predicted by the logits at t - 1
    expected = torch.log_softmax(logits[1, 2], -1)[ids[1, 3]]
    assert lp[1, 3].item() == pytest.approx(expected.item(), abs=1e-6)
    ent = token_entropy(logits)
    dist = torch.distributions.Categorical(logits=logits[0, 1])
    assert ent[0, 2].item() == pytest.approx(dist.entropy().item(), abs=1e-6)
    assert (ent[:, 0] == 0).all()


def test_token_choice_entropy_is_the_binary_entropy_of_one_token_where_asked():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    where = torch.zeros(2, 4)
    where[0, 2] = where[1, 1] = 1
    entropy = token_choice_entropy(logits, 3, where)
    for row, t in ((0, 2), (1, 1)):
        p = torch.softmax(logits[row, t - 1], -1)[3].item()
        assert entropy[row, t].item() == pytest.approx(-p * math.log(p) - (1 - p) * math.log(1 - p),
                                                       abs=1e-6)
    assert entropy[where == 0].abs().max() == 0
    # The gradient moves token 3 against the rest and leaves the rest's proportions alone:
    # on every other token it is proportional to that token's probability.
    entropy.sum().backward()
    grad, probs = logits.grad[0, 1], torch.softmax(logits[0, 1].detach(), -1)
    others = [j for j in range(7) if j != 3]
    ratios = grad[others] / probs[others]
    torch.testing.assert_close(ratios, ratios[:1].expand_as(ratios))
    assert logits.grad[0, 0].abs().max() == 0  # predicts no decision token
    # Certain choices have zero entropy and stay finite.
    certain = torch.full((1, 2, 5), -50.0)
    certain[0, 0, 1] = 50.0
    assert token_choice_entropy(certain, 1,
                                torch.ones(1, 2))[0, 1].item() == pytest.approx(0.0, abs=1e-6)


def test_the_decision_entropy_enters_the_loss_with_its_coefficient():
    logprobs = torch.tensor([[-1.0, -2.0]])
    decision = torch.tensor([[0.6, 0.0]])  # the first token is a root's decision
    config = LossConfig(decision_entropy_coef=0.5)
    loss, _ = per_token_loss(logprobs, logprobs.clone(), torch.tensor([2.0]), torch.ones(1, 2),
                             config,
                             decision_entropy=decision)
    torch.testing.assert_close(loss, torch.tensor([[-2.0 - 0.3, -2.0]]))
    with pytest.raises(ValueError, match="decision entropy"):
        per_token_loss(logprobs, logprobs.clone(), torch.tensor([2.0]), torch.ones(1, 2), config)


# ------------------------------------------------------------------ aggregation

LENGTHS = [2, 4, 4]  # trainable tokens per sample
TREES = [0, 0, 1]  # samples 0 and 1 are the root and a clone of tree 0


def test_aggregation_weights_hand_values():
    # token_mean: 1 / (2 + 4 + 4) = 1/10 for every token
    assert aggregation_weights(LENGTHS, TREES, "token_mean") == pytest.approx([0.1] * 3)
    # seq_mean_token_mean: 1 / (3 samples * L_i) = 1/6, 1/12, 1/12
    assert aggregation_weights(LENGTHS, TREES, "seq_mean_token_mean") == pytest.approx(
        [1 / 6, 1 / 12, 1 / 12])
    # tree_mean: tree 0 holds 6 tokens, tree 1 holds 4; 2 trees -> 1/12, 1/12, 1/8
    assert aggregation_weights(LENGTHS, TREES, "tree_mean") == pytest.approx(
        [1 / 12, 1 / 12, 1 / 8])
    # a sample without trainable tokens weighs nothing and is not counted
    assert aggregation_weights([0, 4], [0, 1], "seq_mean_token_mean") == [0.0, 0.25]
    with pytest.raises(ValueError, match="loss.aggregation"):
        aggregation_weights(LENGTHS, TREES, "sum")


def _padded(rows: list[list[float]]):
    """Right-padded loss and mask tensors of a micro-batch."""
    width = max(len(r) for r in rows)
    loss = torch.tensor([r + [123.0] * (width - len(r)) for r in rows])  # junk in padding
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    return loss, mask


# Token losses of the three samples above.
TOKEN_LOSSES = [[1.0, 3.0], [2.0, 2.0, 2.0, 6.0], [5.0, 5.0, 5.0, 9.0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # all 10 tokens: (4 + 12 + 24) / 10 = 4
        ("token_mean", 4.0),
        # sample means 2, 3, 6 -> (2 + 3 + 6) / 3 = 11/3
        ("seq_mean_token_mean", 11 / 3),
        # tree 0: (4 + 12) / 6 = 8/3; tree 1: 24 / 4 = 6 -> (8/3 + 6) / 2 = 13/3
        ("tree_mean", 13 / 3),
    ],
)
def test_aggregation_is_the_global_mean_whatever_the_micro_batch_split(mode, expected):
    weights = aggregation_weights(LENGTHS, TREES, mode)
    splits = [[[0, 1, 2]], [[0], [1], [2]], [[2, 0], [1]], [[1, 2], [0]]]
    for split in splits:
        total = 0.0
        for micro_batch in split:
            loss, mask = _padded([TOKEN_LOSSES[i] for i in micro_batch])
            w = torch.tensor([weights[i] for i in micro_batch])[:, None]
            total += (loss * w * mask).sum().item()
        assert total == pytest.approx(expected), split


def test_combine_stats_is_token_weighted():
    merged = combine_stats([
        {"tokens": 1.0, "clip_frac_high": 1.0},
        {"tokens": 3.0, "clip_frac_high": 0.0, "kl_ref": 0.4},
    ])
    assert merged == {"tokens": 4.0, "clip_frac_high": 0.25, "kl_ref": pytest.approx(0.4)}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"clip_low": 1.0}, "^clip_low "),
        ({"clip_high": -0.1}, "^clip_high "),
        ({"dual_clip": 1.0}, "^dual_clip "),
        ({"kl_estimator": "k1"}, "^kl_estimator "),
        ({"aggregation": "sum"}, "^aggregation "),
        ({"max_importance_ratio": 0.5}, "^max_importance_ratio "),
        ({"kl_coef": "high"}, "^kl_coef "),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LossConfig(**kwargs)
