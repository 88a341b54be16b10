"""The model's forward pass, below rollout and training: input-aligned logprobs, the shared-
prefix pass, and what a transformers model's signature and cache allow (`forward_logprobs`
is the one forward every logprob of selfcest comes from; the HF backend and the trainer
read the same signature helpers)."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Input-aligned logprobs ``[batch, T]`` of ``input_ids`` under causal-LM ``logits``.

    Position t holds ``log softmax(logits[:, t-1])[input_ids[:, t]]``; position 0 holds 0.
    Computed in float32 as ``logit - logsumexp`` so no second ``[batch, T, vocab]`` tensor of
    log-probabilities is materialised.
    """
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    picked = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))


def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     temperature: float = 1.0, position_ids: torch.Tensor | None = None,
                     from_position: int = 0,
                     share_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Input-aligned logprobs ``[batch, T]`` of ``input_ids`` under ``model``'s logits /
    temperature (`selfcest.algo.losses.token_logprobs`: position 0 holds 0), and those tempered
    logits. The one forward pass every logprob of selfcest comes from: training, warm start,
    sync verification, notebooks.

    Position ids come from the attention mask, so every row of a padded batch sees the
    positions it had when it was sampled alone (that is what makes these logprobs agree with
    the backends' sampled ones). Packed rows (`selfcest.train.batching.collate`) pass no
    mask and their own ``position_ids``, which restart at 0 for every sample; transformers
    keeps the samples apart from those (`supports_packing`).

    ``from_position``: only positions from there on are wanted (earlier logprobs are 0). The
    output layer then skips the positions before it (transformers' ``logits_to_keep``, where
    the model takes it): on prompt tokens, a large share of a big vocabulary's compute. The
    logits returned are those of positions ``from_position - 1`` on (all when it is <= 1).

    ``share_prefix``: where several rows begin with the same ``from_position - 1`` tokens (a
    GRPO group's copies of one prompt), those columns run once per distinct prefix
    (`shared_prefix_logits`). Same logprobs and gradients up to float rounding; used only
    where `shareable_prefix` finds repeated prefixes, one pass as above otherwise.
    """
    if attention_mask is not None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    elif position_ids is None:
        raise ValueError("forward_logprobs needs an attention mask or, for packed rows, position "
                         "ids")
    shared = from_position - 1
    repeated = shareable_prefix(model, input_ids, attention_mask, shared) if share_prefix else None
    if repeated is not None:
        logits = shared_prefix_logits(model, input_ids, attention_mask, position_ids, shared,
                                      *repeated)
        logits = logits / temperature
        return left_pad(token_logprobs(logits, input_ids[:, shared:]), shared), logits
    skipped = max(from_position - 1, 0) if takes_logits_to_keep(model) else 0
    # No KV cache: nothing is decoded after this pass, and transformers only separates
    # packed samples when no cache is passed.
    keep = {"logits_to_keep": input_ids.shape[1] - skipped} if skipped else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, **keep).logits
    logits = logits / temperature
    return left_pad(token_logprobs(logits, input_ids[:, skipped:]), skipped), logits


def shareable_prefix(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     columns: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`repeated_rows` of the first ``columns`` columns, where `shared_prefix_logits` may run
    them once per distinct prefix: unpacked rows all real there, and a model that keeps a
    plain KV cache in this pass (gradient checkpointing drops the cache while it records
    gradients, so the second pass would not see the prefix at all). None otherwise."""
    if attention_mask is None or columns < 1 or not bool(attention_mask[:, :columns].all()):
        return None
    inner = getattr(model, "module", model)
    # The flag transformers' checkpointed layers read before they drop the cache.
    if torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False) and m.training
                                       for m in inner.modules()):
        return None
    if not plain_attention_cache(inner):
        return None
    return repeated_rows(input_ids[:, :columns], attention_mask[:, :columns])


def shared_prefix_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, columns: int, first_rows: torch.Tensor,
                         row_prefix: torch.Tensor) -> torch.Tensor:
    """The logits of columns ``columns`` on (``[rows, T - columns, vocab]``), with the first
    ``columns`` columns run once per distinct prefix (``first_rows``, ``row_prefix``: from
    `shareable_prefix`).

    A first pass over the distinct prefixes fills a KV cache; each row gets its prefix's keys
    and values (an index, through which gradients flow back and add up); a second pass feeds
    the rest of every row against them.
    """
    # The first pass goes around a DDP wrapper: DDP's forward starts with a collective (buffer
    # broadcast), and processes whose micro-batches share no prompt make one pass, not two.
    # DDP's gradient hooks sit on the parameters, so this pass's gradients are all-reduced too.
    inner = getattr(model, "module", model)
    cache = DynamicCache(config=inner.config)
    # the prefix's logits are not wanted
    keep = {"logits_to_keep": 1} if takes_logits_to_keep(inner) else {}
    inner(input_ids=input_ids[first_rows, :columns],
          position_ids=position_ids[first_rows, :columns],
          use_cache=True, **keep, **{cache_argument(inner): cache})
    per_row = [(layer.keys.index_select(0, row_prefix), layer.values.index_select(0, row_prefix))
               for layer in cache.layers]
    cache = DynamicCache(ddp_cache_data=per_row, config=inner.config)
    return model(input_ids=input_ids[:, columns:], attention_mask=attention_mask,
                 position_ids=position_ids[:, columns:], use_cache=True,
                 **{cache_argument(model): cache}).logits


def left_pad(values: torch.Tensor, positions: int) -> torch.Tensor:
    """``values`` of the last positions of a row, input-aligned again: ``positions`` zeros
    in front (as `forward_logprobs` returns them; for `token_entropy` of its logits too)."""
    return torch.nn.functional.pad(values, (positions, 0)) if positions else values


def set_activation_checkpointing(model, enabled: bool = True) -> None:
    """Turn on (or off) ``model``'s recomputing of each layer's activations in the backward:
    transformers' ``activation_checkpointing_enable`` / ``_disable``, or, in releases before
    them, the ``gradient_checkpointing_`` methods (deprecated since, to go in v6). Both set the
    ``gradient_checkpointing`` flag of the layers, which `shareable_prefix` reads."""
    action = "enable" if enabled else "disable"
    switch = (getattr(model, f"activation_checkpointing_{action}", None)
              or getattr(model, f"gradient_checkpointing_{action}"))
    switch()


def takes_logits_to_keep(model) -> bool:
    """Whether the transformers model inside ``model`` (a DDP or peft wrapper's too) can leave
    out leading positions' logits."""
    return "logits_to_keep" in forward_parameters(model)


@torch.no_grad()
def supports_packing(model) -> bool:
    """Whether ``model`` keeps packed samples apart: the logits of a sample packed after
    another equal those of the same sample packed after different tokens (and alone).

    transformers' attention masks do this for models built on its mask utilities when no
    attention mask and no cache are passed; a model that ignores the position ids would let
    a sample attend to its row neighbour, and packed training would be silently wrong.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(0)
    # Ids below 100 exist in any vocabulary.
    first, other, second = (torch.randint(0, 100, (n,), generator=generator) for n in (5, 5, 6))
    device = next(model.parameters()).device
    positions = torch.cat([torch.arange(5), torch.arange(6)])[None].to(device)
    try:
        packed = [forward_logprobs(model, torch.cat([head, second])[None].to(device), None,
                                   position_ids=positions)[1][0, 5:].float()
                  for head in (first, other)]
        alone = forward_logprobs(model, second[None].to(device), torch.ones(1, 6, dtype=torch.long,
                                 device=device))[1][0].float()
    finally:
        model.train(was_training)
    scale = alone.abs().max().clamp(min=1.0)
    return all(bool(((p - alone).abs().max() / scale) < 1e-2) for p in packed)


def repeated_rows(input_ids: torch.Tensor,
                  attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where rows repeat (same tokens, same mask): the first row of each distinct one, and
    for every row the position of its distinct row in that list. None when no row repeats."""
    distinct, row_of = torch.unique(torch.cat([input_ids, attention], dim=1), dim=0,
                                    return_inverse=True)
    if len(distinct) == len(input_ids):
        return None
    rows = torch.arange(len(row_of), device=row_of.device)
    first = torch.full((len(distinct),), len(row_of), device=row_of.device)
    return first.scatter_reduce(0, row_of, rows, "amin"), row_of


def plain_attention_cache(model) -> bool:
    """Whether ``model``'s KV cache is a stack of plain full-attention layers, the only kind
    a cached prefix can be spliced into (not sliding-window, linear or recurrent layers)."""
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # a config transformers cannot read layer types from
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def cache_argument(model) -> str:
    """Name of the KV-cache keyword: ``cache`` in newer transformers, ``past_key_values`` before."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def forward_parameters(model) -> frozenset[str]:
    """The keyword parameters of the transformers model's ``forward`` inside ``model`` (a DDP
    or peft wrapper's too)."""
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return _forward_parameters(type(inner))


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    # Reading a signature costs about as much as a forward pass of a tiny model: once per class.
    return frozenset(inspect.signature(model_class.forward).parameters)
