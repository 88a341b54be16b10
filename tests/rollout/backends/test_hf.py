"""HFBackend on real tiny transformers models: batching, stopping, logprobs, reproducibility."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from selfcest.budget import Budget
from selfcest.modeling import cache_argument, forward_logprobs
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.hf import HFBackend, sample_rows
from selfcest.rollout.engine import RolloutEngine


def generate_all(backend, requests):
    async def main():
        return await asyncio.gather(*(backend.generate(p, **kw) for p, kw in requests))

    return asyncio.run(main())


def prompts(tokenizer, n):
    return [tokenizer.encode("Sum the numbers " * (i + 1) + str(i)) for i in range(n)]


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0),
     SamplingParams(temperature=1.3, top_k=20)],
)
def test_sampled_logprobs_agree_with_a_separate_forward_pass(tiny_policy, sampling):
    backend = HFBackend(tiny_policy.model, tiny_policy.tokenizer.pad_token_id)
    batch = prompts(tiny_policy.tokenizer, 5)
    requests = [(p, dict(max_tokens=12 + i, stop_token_ids=[], sampling=sampling, seed=i))
                for i, p in enumerate(batch)]
    completions = generate_all(backend, requests)
    assert backend.batches == 1  # the five concurrent requests shared one batched decode
    temperature = sampling.temperature or 1.0
    for prompt, completion in zip(batch, completions):
        assert len(completion.token_ids) == len(completion.logprobs) > 0
        full = torch.tensor([prompt + completion.token_ids])
        logp, _ = forward_logprobs(tiny_policy.model, full, torch.ones_like(full), temperature)
        expected = logp[0, len(prompt):]
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


def reference_draw(logits, sampling, generator):
    """One row's token and logprob, the sampling contract spelled out: inverse-CDF over the
    probabilities of logits / T sorted in descending order (after top-k, top-p and banned
    tokens), one uniform draw of the row's generator; greedy rows take the argmax."""
    logp = torch.log_softmax(logits / (sampling.temperature or 1.0), dim=-1)
    probs = logp.exp()
    vocab = probs.shape[-1]
    if sampling.banned_token_ids:
        banned = torch.tensor(sampling.banned_token_ids)
        probs, logits = probs.index_fill(-1, banned,
                                         0.0), logits.index_fill(-1, banned, float("-inf"))
    if sampling.greedy:
        token = logits.argmax(-1)
        return token.item(), logp[token].item()
    sorted_probs, order = torch.sort(probs[None], dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    drop = ((ranks >= (sampling.top_k or vocab))
            | (sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p))
    if sampling.top_k or sampling.top_p < 1:
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    cdf = sorted_probs.cumsum(-1)
    uniform = torch.rand((), generator=generator)
    rank = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    token = order.gather(1, rank)[0, 0]
    return token.item(), logp[token].item()


@torch.inference_mode()
def reference_decode(model, pad_token_id, requests):
    """The decode loop with nothing but what it needs: a left-padded prefill, then one forward
    pass per step for the live rows (a finished row leaves the batch and the KV cache)."""
    from transformers import DynamicCache

    width = max(len(prompt) for prompt, _ in requests)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p, _ in requests])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in requests])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator().manual_seed(kw["seed"]) for _, kw in requests]
    out = [([], []) for _ in requests]
    live, cache = list(range(len(requests))), DynamicCache(config=model.config)
    while True:
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                       use_cache=True,
                       logits_to_keep=1, **{cache_argument(model): cache}).logits[:, -1, :].float()
        keep = []
        for row, i in enumerate(live):
            kw = requests[i][1]
            token, logprob = reference_draw(logits[row], kw["sampling"], generators[i])
            out[i][0].append(token)
            out[i][1].append(logprob)
            if token not in kw["stop_token_ids"] and len(out[i][0]) < kw["max_tokens"]:
                keep.append(row)
        if not keep:
            return out
        cache.batch_select_indices(torch.tensor(keep))
        attention, positions = attention[keep], positions[keep]
        ids = torch.tensor([[out[live[row]][0][-1]] for row in keep])
        attention = torch.cat([attention, attention.new_ones((len(keep), 1))], dim=1)
        positions = positions[:, -1:] + 1
        live = [live[row] for row in keep]


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0),
     SamplingParams(temperature=0, banned_token_ids=(5,)),
     SamplingParams(temperature=0.7, top_p=0.9, top_k=20, banned_token_ids=(5, 9))],
)
def test_decoding_is_bitwise_the_reference_loop(tiny_policy, sampling):
    """Same seeds, same tokens and bitwise the same logprobs as the plain loop above, with
    rows leaving the batch at different steps (own budgets, own stop tokens)."""
    model = tiny_policy.model.eval()
    backend = HFBackend(model, tiny_policy.tokenizer.pad_token_id)
    free = generate_all(backend,
                        [(p, dict(max_tokens=24, stop_token_ids=[], sampling=sampling, seed=i))
                         for i, p in enumerate(prompts(tiny_policy.tokenizer, 6))])
    stops = [[c.token_ids[3 * i]] if i % 2 == 0 else [] for i, c in enumerate(free)]
    requests = [(p, dict(max_tokens=3 + 2 * i, stop_token_ids=stops[i], sampling=sampling, seed=i))
                for i, p in enumerate(prompts(tiny_policy.tokenizer, 6))]
    completions = generate_all(backend, requests)
    expected = reference_decode(model, tiny_policy.tokenizer.pad_token_id, requests)
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert [(c.token_ids, c.logprobs) for c in completions] == expected


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0)])
def test_repeated_prompts_are_prefilled_once_and_sample_as_the_reference_loop(
    tiny_policy, sampling):
    """A batch of three prompts, six rows (a prompt three times, one twice, one once; own
    seeds and budgets): the first pass feeds three rows, and every row samples the tokens the
    plain loop, which prefills all six, samples (logprobs to float rounding: a pass over three
    rows need not round as one over six)."""
    model = tiny_policy.model.eval()
    backend = HFBackend(model, tiny_policy.tokenizer.pad_token_id)
    distinct = prompts(tiny_policy.tokenizer, 3)
    order = [0, 1, 0, 2, 1, 0]
    requests = [(distinct[k],
                 dict(max_tokens=4 + 3 * i, stop_token_ids=[], sampling=sampling, seed=i))
                for i, k in enumerate(order)]
    completions = generate_all(backend, requests)
    expected = reference_decode(model, tiny_policy.tokenizer.pad_token_id, requests)
    assert [c.token_ids for c in completions] == [tokens for tokens, _ in expected]
    for completion, (_, logprobs) in zip(completions, expected):
        assert torch.allclose(torch.tensor(completion.logprobs), torch.tensor(logprobs), atol=1e-5)
    width = max(map(len, distinct))
    assert backend.prefill_tokens == 3 * width and backend.prefill_real_tokens == sum(
        map(len, distinct))
    assert backend.repeated_prompt_tokens == 2 * len(distinct[0]) + len(distinct[1])
    if sampling.temperature:  # own seeds: copies of one prompt draw their own tokens
        assert len({tuple(completions[i].token_ids[:4]) for i in (0, 2, 5)}) == 3


def test_each_row_stops_on_its_own_stop_tokens_and_budget(tiny_policy):
    backend = HFBackend(tiny_policy.model, tiny_policy.tokenizer.pad_token_id)
    batch = prompts(tiny_policy.tokenizer, 6)
    free = generate_all(backend,
                        [(p, dict(max_tokens=40, stop_token_ids=[], sampling=SamplingParams(),
                                  seed=7)) for p in batch])
    # Stop each row on a token it really samples, at different depths: rows stop right there.
    stops = [c.token_ids[3 + i] for i, c in enumerate(free)]
    stopped = generate_all(backend,
                           [(p, dict(max_tokens=40, stop_token_ids=[s], sampling=SamplingParams(),
                                     seed=7)) for p, s in zip(batch, stops)])
    for before, after, stop in zip(free, stopped, stops):
        cut = before.token_ids.index(stop) + 1
        # the stop token is included, nothing after
        assert after.token_ids == before.token_ids[:cut]
        assert after.finish_reason == "stop"
    budgets = [1, 2, 5, 9, 17, 40]
    capped = generate_all(backend,
                          [(p, dict(max_tokens=m, stop_token_ids=[], sampling=SamplingParams(),
                                    seed=7)) for p, m in zip(batch, budgets)])
    for completion, before, budget in zip(capped, free, budgets):
        assert len(completion.token_ids) == budget and completion.finish_reason == "length"
        assert completion.token_ids == before.token_ids[:budget]


def test_a_request_samples_the_same_tokens_alone_or_batched(tiny_policy):
    backend = HFBackend(tiny_policy.model, tiny_policy.tokenizer.pad_token_id)
    batch = prompts(tiny_policy.tokenizer, 4)
    kw = dict(max_tokens=16, stop_token_ids=[], sampling=SamplingParams())
    together = generate_all(backend, [(p, dict(kw, seed=100 + i)) for i, p in enumerate(batch)])
    for i, p in enumerate(batch):
        (alone,) = generate_all(backend, [(p, dict(kw, seed=100 + i))])
        assert alone.token_ids == together[i].token_ids
    (other_seed,) = generate_all(backend, [(batch[0], dict(kw, seed=5))])
    assert other_seed.token_ids != together[0].token_ids


def test_branches_of_many_trees_share_batches(spawning_policy, demo_task):
    backend = spawning_policy.backend()
    engine = RolloutEngine(backend, spawning_policy.protocol, Budget(max_depth=1),
                           SamplingParams(temperature=0))
    trees = engine.rollout([demo_task] * 4, samples_per_task=2)
    for tree in trees:
        assert tree.costs().clones == 2 and tree.answer == "10"
        assert [tree.nodes[c].answer for c in tree.root.children] == ["3", "7"]
    # 8 roots decode together, then their 16 clones together, then the 8 roots resume together.
    assert backend.batches == 3


def test_without_spawning_a_spawn_call_costs_no_extra_decode(spawning_policy, demo_task):
    """With max_depth=0 the policy's spawn call does not stop its row: every root decodes
    in the one batch, one forward pass per token of the longest root, and nothing else."""
    backend = spawning_policy.backend()
    engine = RolloutEngine(backend, spawning_policy.protocol,
                           Budget(max_depth=0, node_generation=40),
                           SamplingParams())
    trees = engine.rollout([demo_task], samples_per_task=4)
    end = spawning_policy.protocol.spawn_stop_id
    assert all(end in t.root.segments[0].token_ids for t in trees)  # each root wrote a call
    assert all([s.kind for s in t.root.segments] == ["sampled"] for t in trees)
    assert backend.batches == 1
    assert backend.forward_passes == max(t.root.generated_tokens for t in trees)


@pytest.mark.parametrize("policy_name", ["spawning_policy", "tiny_policy"])
def test_seeded_rollouts_are_reproducible(policy_name, demo_task, request):
    policy = request.getfixturevalue(policy_name)

    def sample(seed):
        engine = policy.engine(Budget(max_depth=1, node_generation=24), SamplingParams(), seed=seed)
        return [t.to_json() for t in engine.rollout([demo_task], samples_per_task=3)]

    first = sample(3)
    assert sample(3) == first
    if policy_name == "tiny_policy":  # random weights: high entropy, so seeds must matter
        assert sample(4) != first


def test_sync_serves_the_new_weights_under_a_new_version(tiny_policy):
    """After sync_weights(other), the backend samples from the other model's distribution:
    its logprobs are the other model's, not the old ones."""
    served = copy.deepcopy(tiny_policy.model)
    trained = copy.deepcopy(tiny_policy.model)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.05 * torch.randn_like(param))
    backend = HFBackend(served, tiny_policy.tokenizer.pad_token_id)
    prompt = prompts(tiny_policy.tokenizer, 1)[0]
    request = dict(max_tokens=6, stop_token_ids=[], sampling=SamplingParams(), seed=0)

    def sample_and_score(model):
        (completion,) = generate_all(backend, [(prompt, request)])
        ids = torch.tensor([prompt + completion.token_ids])
        logp = forward_logprobs(model, ids, torch.ones_like(ids))[0][0, len(prompt):]
        return completion, torch.tensor(completion.logprobs), logp

    before, sampled, old_logp = sample_and_score(tiny_policy.model)
    assert before.weight_version == 0 and torch.allclose(sampled, old_logp, atol=1e-5)
    backend.sync_weights(trained)
    after, sampled, new_logp = sample_and_score(trained)
    assert after.weight_version == 1
    assert torch.allclose(sampled, new_logp, atol=1e-5)
    ids = torch.tensor([prompt + after.token_ids])
    stale = forward_logprobs(tiny_policy.model, ids, torch.ones_like(ids))[0][0, len(prompt):]
    assert (sampled - stale).abs().max() > 1e-2


def node_tokens(trees):
    return [{node_id: node.context_ids() for node_id, node in tree.nodes.items()} for tree in trees]


def test_a_resumed_node_prefills_only_what_its_cached_prefix_does_not_cover(
    spawning_policy, demo_task):
    """Roots that stop on their spawn call keep their KV cache; resuming with the clones'
    answers prefills only the answers, and the trees are those sampled without the cache."""

    def rollout(prefix_cache_mb):
        backend = HFBackend(spawning_policy.model, spawning_policy.tokenizer.pad_token_id,
                            prefix_cache_mb=prefix_cache_mb)
        engine = RolloutEngine(backend, spawning_policy.protocol, Budget(max_depth=1),
                               SamplingParams(temperature=0))
        return engine.rollout([demo_task] * 4, samples_per_task=2), backend

    trees, cached = rollout(512)
    plain_trees, plain = rollout(0)
    assert node_tokens(trees) == node_tokens(plain_trees)
    assert all(tree.answer == "10" for tree in trees)
    # A resumed root's cache holds its prompt and its turn up to the spawn-close token.
    resumed = sum(len(t.root.prompt_ids) + len(t.root.segments[0].token_ids) - 1 for t in trees)
    assert cached.cached_prompt_tokens == resumed > 0 and plain.cached_prompt_tokens == 0
    # The same requests in both runs: what the cache does not hold is fed, or repeats a row.
    assert (plain.prefill_real_tokens + plain.repeated_prompt_tokens
            - cached.prefill_real_tokens - cached.repeated_prompt_tokens) == resumed


def stop_and_resume_requests(tokenizer, backend, count, sampling):
    """``count`` first calls that stop on a token they sample (a resume token) at different
    depths, and the prompts that resume them with suffixes of different lengths."""
    first_prompts = prompts(tokenizer, count)
    free = generate_all(backend,
                        [(p, dict(max_tokens=16, stop_token_ids=[], sampling=sampling, seed=i))
                         for i, p in enumerate(first_prompts)])
    stops = [[c.token_ids[2 + 3 * i]] for i, c in enumerate(free)]
    first = generate_all(backend, [
        (p,
         dict(max_tokens=16, stop_token_ids=stop, resume_token_ids=stop, sampling=sampling, seed=i))
        for i, (p, stop) in enumerate(zip(first_prompts, stops))])
    assert all(c.finish_reason == "stop" for c in first)
    resumed = [p + c.token_ids + tokenizer.encode(" answer" * (1 + 2 * i))
               for i, (p, c) in enumerate(zip(first_prompts, first))]
    # What each first call leaves cached: its prompt and tokens up to the resume token.
    return resumed, [len(p) + len(c.token_ids) - 1 for p, c in zip(first_prompts, first)]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0)])
def test_a_cached_prefix_samples_what_a_full_prefill_samples(tiny_policy, sampling):
    """Resumed rows whose cached prefixes differ in length, batched with fresh prompts longer
    and shorter than their uncached parts (so some rows recompute part of their prefix):
    the same tokens as without the cache, and the logprobs within float noise."""
    tokenizer, pad = tiny_policy.tokenizer, tiny_policy.tokenizer.pad_token_id
    model = tiny_policy.model.eval()
    fresh = [prompts(tokenizer, 2)[1], tokenizer.encode("Sum")]
    results = []
    for prefix_cache_mb in (512, 0):
        backend = HFBackend(model, pad, prefix_cache_mb=prefix_cache_mb)
        resumed, stored = stop_and_resume_requests(tokenizer, backend, 3, sampling)
        second = generate_all(backend, [(p, dict(max_tokens=10, stop_token_ids=[],
                                                 sampling=sampling, seed=50 + i))
                                        for i, p in enumerate(resumed + fresh)])
        results.append((second, backend))
    (cached, with_cache), (plain, without) = results
    # The first pass feeds the longest uncached part of any prompt; each resumed row takes
    # from its cache only the columns before that.
    fed = max([len(p) - n for p, n in zip(resumed, stored)] + [len(p) for p in fresh])
    used = [max(0, len(p) - fed) for p in resumed]
    assert any(0 < u < n for u, n in zip(used, stored))  # a row that recomputes part of its prefix
    assert with_cache.cached_prompt_tokens == sum(used) > 0 and without.cached_prompt_tokens == 0
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]
    for a, b in zip(cached, plain):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_a_cached_prefix_is_not_used_once_the_weights_change(tiny_policy):
    model = copy.deepcopy(tiny_policy.model).eval()
    backend = HFBackend(model, tiny_policy.tokenizer.pad_token_id)
    (resumed,), _ = stop_and_resume_requests(tiny_policy.tokenizer, backend, 1, SamplingParams())
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))  # an optimizer step, without a sync
    (completion,) = generate_all(backend, [(resumed, dict(max_tokens=6, stop_token_ids=[],
                                                          sampling=SamplingParams(), seed=0))])
    assert backend.cached_prompt_tokens == 0
    ids = torch.tensor([resumed + completion.token_ids])
    logp = forward_logprobs(model, ids, torch.ones_like(ids))[0][0, len(resumed):]
    assert torch.allclose(torch.tensor(completion.logprobs), logp, atol=1e-5)


def test_models_with_sliding_window_layers_get_no_prefix_cache():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                         sliding_window=8, max_window_layers=0)
    assert HFBackend(Qwen2ForCausalLM(config), 0).prefix_cache is None


def test_bad_requests_fail_clearly(tiny_policy):
    backend = HFBackend(tiny_policy.model, tiny_policy.tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        generate_all(backend, [([1, 2], dict(max_tokens=0, stop_token_ids=[],
                                             sampling=SamplingParams(), seed=0))])
    with pytest.raises(ValueError, match="empty prompt"):
        generate_all(backend, [([], dict(max_tokens=3, stop_token_ids=[], sampling=SamplingParams(),
                                         seed=0))])


def test_token_fidelity_with_a_real_model(spawning_policy, demo_task):
    """The training sequence of every node is exactly what its backend calls saw and sampled,
    plus the injected tokens, and the recorded logprobs are the sampled tokens' logprobs."""
    backend = spawning_policy.backend()
    seen = []
    original = backend.generate

    async def recording(prompt_ids, **kwargs):
        completion = await original(prompt_ids, **kwargs)
        seen.append((list(prompt_ids), completion))
        return completion

    backend.generate = recording
    engine = RolloutEngine(backend, spawning_policy.protocol, Budget(max_depth=1), seed=1)
    (tree,) = engine.rollout([demo_task])
    by_prompt = {tuple(p): c for p, c in seen}
    for node in tree.nodes.values():
        context = list(node.prompt_ids)
        for segment in node.segments:
            if segment.trainable:
                completion = by_prompt[tuple(context)]
                assert segment.token_ids == completion.token_ids
                ids = torch.tensor([context + segment.token_ids])
                logp = forward_logprobs(spawning_policy.model, ids,
                                        torch.ones_like(ids))[0][0, len(context):]
                assert torch.allclose(logp, torch.tensor(segment.logprobs), atol=1e-4)
            context += segment.token_ids
        assert context == node.context_ids()
    assert len(seen) == sum(1 for n in tree.nodes.values() for s in n.segments if s.trainable)


def test_banned_tokens_are_never_drawn_and_keep_the_untruncated_logprobs():
    """Token 0 takes 98% of the mass; banned, it is never drawn, greedy or sampled, alone or
    with top-k, and every drawn token reports its logprob before the ban."""
    logits = torch.tensor([[5.0, 1.0, 0.5, -1.0]])
    full = torch.log_softmax(logits[0], -1)
    cases = [SamplingParams(banned_token_ids=(0,)),
             SamplingParams(temperature=0, banned_token_ids=(0,)),
             SamplingParams(top_k=2, banned_token_ids=(0, 1))]
    for sampling in cases:
        for seed in range(50):
            (token,), (logprob,) = sample_rows(logits, [sampling],
                                               [torch.Generator().manual_seed(seed)])
            assert token not in sampling.banned_token_ids
            assert logprob == pytest.approx(full[token].item())
        if sampling.greedy:
            assert token == 1
    drawn = {sample_rows(logits, [SamplingParams()], [torch.Generator().manual_seed(s)])[0][0]
             for s in range(50)}
    assert 0 in drawn  # without the ban the favourite is drawn


def test_greedy_batches_sort_nothing_and_draw_nothing(monkeypatch):
    """An argmax needs no sorted distribution and no uniform: an all-greedy batch calls no
    sort and leaves every generator as it was."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    generators = [torch.Generator().manual_seed(seed) for seed in range(3)]
    states = [g.get_state() for g in generators]
    monkeypatch.setattr(torch, "sort", None)
    tokens, logprobs = sample_rows(logits, [SamplingParams(temperature=0)] * 3, generators)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == torch.log_softmax(logits, -1).max(-1).values.tolist()
    assert all(torch.equal(g.get_state(), state) for g, state in zip(generators, states))
