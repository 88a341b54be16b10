"""Policy losses on token tensors, and exact aggregation of the loss over a whole step.

Per-token tensors are ``[batch, T]`` and input-aligned (the conventions: the comment above
`per_token_loss`).

The loss of one token is::

    loss = w_is * pg + kl_coef * kl(logp, ref) - entropy_coef * H - decision_entropy_coef * H_d

with ``pg`` the PPO-clip term (`per_token_loss`), ``w_is`` an optional truncated importance
weight, ``kl`` the k3 (or k2) estimator (`kl_penalty`) and ``H_d`` nonzero only on a root's
first sampled token, the decision whether to delegate (`token_choice_entropy`). How token
losses are averaged over a step is `aggregation_weights`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfcest.configure import Choice, is_number, require, setting


class Aggregation(Choice):
    """How a step's token losses are averaged (see `aggregation_weights`)."""

    token_mean = "token_mean"  # every trainable token weighs the same
    seq_mean_token_mean = "seq_mean_token_mean"  # every node weighs the same
    tree_mean = "tree_mean"  # every tree weighs the same, however many clones it has


class KLEstimator(Choice):
    k2 = "k2"  # (logp - ref)^2 / 2
    k3 = "k3"  # exp(ref - logp) - (ref - logp) - 1: low variance, unbiased, >= 0


AGGREGATIONS = tuple(mode.value for mode in Aggregation)

# log(pi/pi_old) is clamped to +-20 before exp: a ratio of e^20 is clipped anyway for
# positive advantages, and unclamped it overflows float32 (and bf16) to inf.
_LOG_RATIO_CLAMP = 20.0


@dataclass
class LossConfig:
    """PPO-clip loss settings; every one of them takes effect (docs/reference.md §9.1)."""

    clip_low: float = setting(0.2, help="the ratio is clipped below at 1 - clip_low (binds where "
                                        "the advantage is negative)")
    clip_high: float = setting(0.2, help="the ratio is clipped above at 1 + clip_high (binds where "
                                         "the advantage is positive)")
    dual_clip: float | None = setting(None, help=(
        "dual clip: null, or c > 1 capping a negative-advantage token's loss at c * |A|, so a "
        "token whose ratio exploded cannot dominate the step (reference: 3.0)"))
    kl_coef: float = setting(0.0, help="weight of the KL penalty to the reference policy; 0 turns "
                                       "it off (reference: 5e-4)")
    kl_estimator: KLEstimator = setting(KLEstimator.k3, help=(
        "k3: exp(ref - logp) - (ref - logp) - 1 (low variance, unbiased, >= 0; the reference's "
        "low_var_kl); k2: (logp - ref)^2 / 2"))
    kl_clamp: float = setting(10.0, help=(
        "per-token KL estimates are clamped to [-kl_clamp, kl_clamp] (the reference's 10), which "
        "also stops the gradient of tokens whose estimate exceeds it"))
    entropy_coef: float = setting(0.0, help="weight of the entropy bonus; 0 turns it off")
    decision_entropy_coef: float = setting(0.0, help=(
        "weight of a bonus on the binary entropy of the root's first token being the spawn-open "
        "token (the decision to delegate), so groups keep holding both styles until the reward "
        "gap between them is clear: at equilibrium logit P(delegate) = gap / coef, in reward "
        "units (docs/controller.md); 0 turns it off"))
    aggregation: Aggregation = setting(Aggregation.tree_mean, help=(
        "how token losses are averaged over a step: tree_mean (every tree weighs the same), "
        "token_mean or seq_mean_token_mean (a tree with 8 clones outweighs one without 9:1); "
        "see aggregation_weights"))
    max_importance_ratio: float = setting(2.0, help=(
        "cap C of the truncated importance weight min(pi_old / pi_behaviour, C), applied to "
        "samples drawn under an older weight version, old logprobs recomputed"))

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef", "kl_clamp", "entropy_coef",
                     "decision_entropy_coef", "max_importance_ratio"):
            value = getattr(self, name)
            require(is_number(value) and math.isfinite(value) and value >= 0, name,
                    f"must be a finite number >= 0; got {value!r}")
        require(self.clip_low < 1, "clip_low",
                f"must be < 1 (the ratio floor is 1 - clip_low); got {self.clip_low}")
        require(self.kl_clamp > 0, "kl_clamp", "must be > 0")
        require(self.max_importance_ratio >= 1, "max_importance_ratio",
                f"must be >= 1; got {self.max_importance_ratio}")
        require(self.dual_clip is None or (is_number(self.dual_clip) and self.dual_clip > 1),
                "dual_clip",
                f"must be null or a number > 1; got {self.dual_clip!r}")
        require(self.kl_estimator in tuple(KLEstimator), "kl_estimator",
                f"must be one of {', '.join(e.value for e in KLEstimator)}; got "
                f"{self.kl_estimator!r}")
        require(self.aggregation in AGGREGATIONS, "aggregation",
                f"must be one of {', '.join(AGGREGATIONS)}; got {self.aggregation!r}")


# Conventions. Every per-token tensor is ``[batch, T]`` and *input-aligned*: position t is about
# token ``input_ids[:, t]``, whose logprob comes from the logits at position t - 1
# (`selfcest.modeling.token_logprobs` does that shift, in one place). ``mask`` is 1 exactly on
# sampled tokens, the only ones trained on; position 0 is always a prompt token, so nothing is
# lost by it having no logprob.
def per_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    decision_entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of every token, 0 where ``mask`` is 0, and statistics of this micro-batch.

    With ``r = exp(logp - logp_old)`` and advantage A (one per sequence ``[batch]``, or one
    per token ``[batch, T]``)::

        pg = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        pg = min(pg, -A * dual_clip)            where A < 0, if dual_clip is set

    ``behaviour_logprobs`` (optional) are the logprobs under which the tokens were sampled
    when ``old_logprobs`` were recomputed under newer weights (decoupled PPO): ``pg`` is then
    multiplied by the constant ``min(exp(old - behaviour), max_importance_ratio)``.
    The KL term needs ``ref_logprobs`` when ``kl_coef > 0``; the entropy bonus needs
    ``entropy`` (per token, e.g. `token_entropy`) when ``entropy_coef > 0``; the decision bonus
    needs ``decision_entropy`` (`token_choice_entropy`, zero off the decision tokens) when
    ``decision_entropy_coef > 0``.

    Statistics are means over this micro-batch's masked tokens (``tokens`` is their count;
    merge micro-batches with `combine_stats`): ``clip_frac_low`` / ``clip_frac_high`` (share
    of tokens whose clipped branch is active, i.e. whose gradient the clip removed),
    ``dual_clip_frac``, ``ratio_mean``, ``approx_kl_old`` (k3 estimate of KL(old || new):
    ``r - 1 - log r``), ``pg_loss``, and when given ``kl_ref``, ``entropy``,
    ``importance_weight_mean``, ``importance_truncated_frac``.
    """
    mask = mask.bool()

    def masked(values: torch.Tensor) -> torch.Tensor:
        # Off-mask positions may hold anything (padding, -inf); zero them before any
        # arithmetic, so neither the loss nor its gradient can turn into inf or NaN there.
        return torch.where(mask, values, 0.0)

    logprobs, old_logprobs = masked(logprobs), masked(old_logprobs)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    if config.dual_clip is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * config.dual_clip), pg)

    importance = None
    if behaviour_logprobs is not None:
        log_w = old_logprobs - masked(behaviour_logprobs)
        log_cap = math.log(config.max_importance_ratio)
        importance = torch.exp(log_w.clamp(max=log_cap)).detach()
        pg = pg * importance

    loss = pg
    # The KL to the reference is computed whenever given, so it is logged even when off.
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, masked(ref_logprobs), config.kl_estimator, config.kl_clamp)
    if config.kl_coef > 0:
        if kl is None:
            raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
        loss = loss + config.kl_coef * kl
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("loss.entropy_coef > 0 needs the per-token entropy")
        entropy = masked(entropy)
        loss = loss - config.entropy_coef * entropy
    if config.decision_entropy_coef > 0:
        if decision_entropy is None:
            raise ValueError("loss.decision_entropy_coef > 0 needs the decision entropy")
        loss = loss - config.decision_entropy_coef * masked(decision_entropy)
    loss = masked(loss)

    with torch.no_grad():
        tokens = int(mask.sum())

        def mean(values: torch.Tensor) -> float:
            return float(values[mask].float().sum() / tokens) if tokens else 0.0

        positive = (advantages > 0).expand_as(mask)
        negative = (advantages < 0).expand_as(mask)
        stats = {
            "tokens": float(tokens),
            "clip_frac_low": mean(negative & (ratio < 1 - config.clip_low)),
            "clip_frac_high": mean(positive & (ratio > 1 + config.clip_high)),
            "dual_clip_frac": (
                mean(negative & (ratio > config.dual_clip)) if config.dual_clip else 0.0
            ),
            "ratio_mean": mean(ratio),
            "approx_kl_old": mean(ratio - 1 - log_ratio),
            "pg_loss": mean(pg),
        }
        if kl is not None:
            stats["kl_ref"] = mean(kl)
        if entropy is not None:
            stats["entropy"] = mean(entropy)
        if importance is not None:
            stats["importance_weight_mean"] = mean(importance)
            stats["importance_truncated_frac"] = mean(log_w > log_cap)
    return loss, stats


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", clamp: float = 10.0
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi.

    With ``d = ref - logp``: ``k3 = exp(d) - d - 1`` (``d`` clamped to +-20 against
    overflow), ``k2 = d^2 / 2``. Both are >= 0; the result is clamped to [-clamp, clamp],
    as the reference does with 10.
    """
    delta = ref_logprobs - logprobs
    if estimator == "k3":
        delta = delta.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        value = torch.exp(delta) - delta - 1
    elif estimator == "k2":
        value = 0.5 * delta.square()
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of "
                         f"{[e.value for e in KLEstimator]}")
    return value.clamp(-clamp, clamp)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Input-aligned entropy ``[batch, T]`` of the distribution each token was drawn from.

    Position t holds ``H(softmax(logits[:, t-1])) = logsumexp(z) - sum softmax(z) * z``;
    position 0 holds 0.
    """
    shifted = logits[:, :-1].float()
    probs = torch.softmax(shifted, dim=-1)
    entropy = torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))


def token_choice_entropy(logits: torch.Tensor, token_id: int, where: torch.Tensor) -> torch.Tensor:
    """Input-aligned binary entropy ``[batch, T]`` of drawing ``token_id`` or any other token,
    at the positions ``where`` is true (0 elsewhere): position t holds ``H(p)`` with
    ``p = softmax(logits[:, t-1])[token_id]``. Its gradient moves only that token's
    probability against the rest, which keeps a two-way choice open without flattening the
    rest of the distribution as `token_entropy` would."""
    shifted = logits[:, :-1].float()
    log_p = shifted[..., token_id] - torch.logsumexp(shifted, dim=-1)
    # log(1 - p) = log(-expm1(log p)), accurate when p is near 1; the clamp keeps it finite.
    log_rest = torch.log(-torch.expm1(log_p.clamp(max=-1e-7)))
    entropy = -(log_p.exp() * log_p + (-torch.expm1(log_p)) * log_rest)
    return torch.where(where.bool(), torch.nn.functional.pad(entropy, (1, 0)), 0.0)


def aggregation_weights(
    lengths: Sequence[int], tree_ids: Sequence[int], mode: str
) -> list[float]:
    """One per-token weight per sample, so that a step's loss is an exact global mean.

    ``lengths[i]`` is the number of trainable (masked) tokens of sample i, ``tree_ids[i]``
    the tree it came from. With ``w_i`` the result, the step's loss is
    ``sum over micro-batches of (loss_per_token * w[:, None] * mask).sum()``, whatever way
    the samples are split into micro-batches:

    - ``token_mean``: every trainable token of the step weighs the same,
      ``w_i = 1 / sum_j L_j``;
    - ``seq_mean_token_mean``: the mean over samples of each sample's token mean,
      ``w_i = 1 / (S * L_i)`` with S the number of samples (the reference's effective mode);
    - ``tree_mean``: the mean over trees of each tree's token mean (all its nodes' tokens
      together), ``w_i = 1 / (N_trees * sum_{j in tree(i)} L_j)``: a tree weighs the same
      however many clones it has.

    Samples without trainable tokens get weight 0 and are not counted. Call this once per
    optimizer step with that step's samples. Under data parallelism, pass every rank's
    samples and multiply each rank's loss by the world size, since DDP averages gradients.
    """
    if len(lengths) != len(tree_ids):
        raise ValueError(f"{len(lengths)} lengths but {len(tree_ids)} tree ids")
    if any(n < 0 for n in lengths):
        raise ValueError("token counts must be >= 0")
    counted = [i for i, n in enumerate(lengths) if n > 0]
    weights = [0.0] * len(lengths)
    if not counted:
        return weights
    if mode == "token_mean":
        total = sum(lengths)
        for i in counted:
            weights[i] = 1.0 / total
    elif mode == "seq_mean_token_mean":
        for i in counted:
            weights[i] = 1.0 / (len(counted) * lengths[i])
    elif mode == "tree_mean":
        tree_tokens: dict[int, int] = defaultdict(int)
        for i in counted:
            tree_tokens[tree_ids[i]] += lengths[i]
        for i in counted:
            weights[i] = 1.0 / (len(tree_tokens) * tree_tokens[tree_ids[i]])
    else:
        raise ValueError(f"loss.aggregation must be one of {', '.join(AGGREGATIONS)}, got {mode!r}")
    return weights


def combine_stats(stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """Merge `per_token_loss` statistics of several micro-batches into token-weighted means."""
    total = sum(s["tokens"] for s in stats)
    merged: dict[str, float] = {"tokens": total}
    for key in sorted({k for s in stats for k in s} - {"tokens"}):
        present = [s for s in stats if key in s]
        weight = sum(s["tokens"] for s in present)
        merged[key] = sum(s[key] * s["tokens"] for s in present) / weight if weight else 0.0
    return merged
