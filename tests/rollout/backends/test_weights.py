"""A trainer's weights as a plain checkpoint: names, peft merging, checks, streaming."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from selfcest.policy import ClonePolicy, apply_lora
from selfcest.rollout.backends.weights import (
    WeightSyncError,
    check_layout,
    checkpoint_entries,
    folder_layout,
    layout_of,
    stream,
    weights_stamp,
)


def adapted(policy: ClonePolicy, trainable_tokens: bool):
    """LoRA (and, if asked, the protocol tokens' rows) on a copy, moved off their zero start."""
    tokens = (policy.tokenizer.convert_tokens_to_ids(list(policy.protocol.required_tokens))
              if trainable_tokens else None)
    model = apply_lora(copy.deepcopy(policy.model), {"r": 4, "alpha": 8}, tokens)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "trainable_tokens_delta" in name:
                parameter.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("trainable_tokens", [False, True], ids=["lora", "lora+protocol_tokens"])
def test_peft_layers_are_merged_into_the_checkpoint_save_pretrained_writes(
    tiny_policy, tmp_path, trainable_tokens):
    """What the engine receives is what a merged save holds, name for name and bit for bit:
    peft's trainable tokens (apply_lora trains the protocol tokens' rows) used to reach the
    engine as their own tensors, which its layout check refused at the first sync."""
    model = adapted(tiny_policy, trainable_tokens)
    ClonePolicy(model, tiny_policy.tokenizer, tiny_policy.protocol).save_pretrained(tmp_path)
    entries = checkpoint_entries(model)
    check_layout(entries, folder_layout(tmp_path))
    saved, sent = load_file(tmp_path / "model.safetensors"), dict(stream(entries, torch.float32))
    assert set(sent) == set(saved) | {"lm_head.weight"}  # the tied head under its own name too
    assert all(torch.equal(sent[name], saved[name]) for name in saved)
    assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])
    assert not any(getattr(module, "merged", False) for module in model.modules())  # left as it was


def test_a_model_of_another_layout_is_refused_before_anything_is_read(tiny_policy):
    layout = layout_of(checkpoint_entries(tiny_policy.model))
    other = ClonePolicy.build_tiny(size="mini")
    with pytest.raises(WeightSyncError, match="has shape"):
        check_layout(checkpoint_entries(other.model), layout)
    partial = copy.deepcopy(tiny_policy.model)
    del partial.model.layers[1]
    with pytest.raises(WeightSyncError, match="model.layers.1.self_attn.q_proj.weight missing"):
        check_layout(checkpoint_entries(partial), layout)


def test_streaming_reads_one_tensor_at_a_time_and_a_tied_one_once(tiny_policy):
    entries = checkpoint_entries(tiny_policy.model)
    reads = []

    def counted(entry):
        def read():
            reads.append(entry.name)
            return entry.read()
        return read

    entries = [type(e)(e.name, e.shape, e.source, counted(e)) for e in entries]
    weights = stream(entries, torch.bfloat16)
    name, tensor = next(weights)
    assert reads == [name] and tensor.dtype == torch.bfloat16  # nothing read ahead
    rest = list(weights)
    # the tied head is not read again
    assert len(rest) + 1 == len(entries) and len(reads) == len(entries) - 1


def test_the_stamp_changes_with_every_write_to_the_weights(tiny_policy):
    model = copy.deepcopy(tiny_policy.model)
    before = weights_stamp(model)
    assert weights_stamp(model) == before
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert weights_stamp(model) != before
