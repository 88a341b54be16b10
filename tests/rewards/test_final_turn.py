"""Rewards read the root's final turn as the engine decodes it: without any special token of
the tokenizer, whatever its end-of-sequence style, and never from an unfinished spawn call."""

from __future__ import annotations

import pytest

from selfcest.budget import Budget
from selfcest.policy import build_tokenizer
from selfcest.protocol import TokenProtocol, ToolCallProtocol
from selfcest.rewards.arithmetic import arithmetic_reward
from selfcest.rewards.math import math_reward
from selfcest.rewards.qa import qa_reward
from selfcest.rollout.backends.scripted import ScriptedBackend
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task

# End-of-sequence conventions: ChatML (Qwen), Llama-2 / Mistral, Gemma, Llama-3.
EOS_STYLES = ["<|im_end|>", "</s>", "<eos>", "<|eot_id|>"]


def tokenizer_with_eos(eos: str):
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"eos_token": eos})
    assert tokenizer.convert_tokens_to_ids(eos) == tokenizer.eos_token_id
    return tokenizer


def root_saying(tokenizer, text: str, protocol=TokenProtocol, budget: Budget | None = None):
    """The tree of a root whose one turn is ``text`` (the backend appends the EOS token)."""
    backend = ScriptedBackend(tokenizer, lambda prompt: text)
    engine = RolloutEngine(backend, protocol(tokenizer), budget or Budget())
    (tree,) = engine.rollout([Task("t", "q", "?")])
    return tree, backend


@pytest.mark.parametrize("eos", EOS_STYLES)
@pytest.mark.parametrize("protocol", [TokenProtocol, ToolCallProtocol])
def test_correct_answers_score_whatever_the_eos_token(eos, protocol):
    tokenizer = tokenizer_with_eos(eos)
    tree, backend = root_saying(tokenizer, "Answer: Paris", protocol)
    assert backend.calls[0].completion.token_ids[-1] == tokenizer.eos_token_id
    assert tree.root.last_turn_text() == "Answer: Paris" + eos  # the sampled text keeps it
    result = qa_reward(cost=None)(tree, Task("t", "q", "Paris"))
    assert result.correct and result.info["qa/em"] == 1.0 and result.info["qa/f1"] == 1.0

    tree, _ = root_saying(tokenizer, "Answer: 1/2", protocol)
    assert math_reward(cost=None)(tree, Task("t", "q", "\\frac{1}{2}")).correct
    tree, _ = root_saying(tokenizer, "Answer: 1,234", protocol)
    assert arithmetic_reward(cost=None)(tree, Task("t", "q", "1234")).correct


def test_an_unfinished_spawn_call_is_not_scored_as_the_answer():
    tokenizer = tokenizer_with_eos("<|im_end|>")
    budget = Budget(node_generation=20, tree_generation=64)
    tree, _ = root_saying(tokenizer, "<spawn>compute 1+2<sep>compute 3 then stop", budget=budget)
    assert tree.root.finish_reason == "budget"
    assert tree.root.last_turn_text() == "<spawn>compute 1+2<sep>compute 3"
    result = arithmetic_reward(cost=None)(tree, Task("t", "q", "3"))
    assert not result.correct and result.info["answer_missing"] == 1.0
