"""Every setting is declared once.

The config classes are those the programs compose (`ROOTS`) and every dataclass their fields
hold. A setting is *the same key declared twice* when

- two classes declare a field of the same name with the same help text (a copy; a subclass
  that inherits a field declares nothing), or
- a section declares a field that a section above it on the same path also declares
  (``algo.samples`` beside ``algo.credit.samples``: one setting reachable at two paths),
  unless `DISTINCT` says why the two are different settings.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator

from selfcest.eval.config import EvalConfig
from selfcest.experiments.controller_sweep import SweepConfig
from selfcest.train.config import TrainConfig

ROOTS = (TrainConfig, EvalConfig, SweepConfig)

# (field name, a class declaring it): different settings under one name and, where the help
# text is the same too, one description that fits both.
DISTINCT = {
    ("name", "ModelConfig"): "the run's name above, the model's here",
    ("name", "TaskConfig"): "the run's name above, the task source's here",
    ("name", "TaskSourceConfig"): "the run's name above, a warm-start task source's here",
    ("budget", "MethodConfig"): "a method's overrides of the evaluation's base budget",
    ("seed", "VLLMConfig"): "the vLLM engine's own seed, below selfcest-eval's rollout seed",
    ("top_p", "EvalConfig"): "selfcest-eval's sampling, not the training rollout's",
    ("top_k", "EvalConfig"): "selfcest-eval's sampling, not the training rollout's",
    ("weight_decay", "SFTConfig"): "the warm start's optimizer, not RL's",
    ("max_grad_norm", "SFTConfig"): "the warm start's optimizer, not RL's",
}


def nested(hint) -> Iterator[type]:
    """The config classes a field's type holds (through Optional, lists and dicts)."""
    if dataclasses.is_dataclass(hint):
        yield hint
    for arg in typing.get_args(hint):
        yield from nested(arg)


def declarer(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose own body declares field ``name``."""
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


def walk(cls: type, above: tuple[type, ...] = ()) -> Iterator[tuple[type, tuple[type, ...]]]:
    """Every config class under ``cls``, with the classes above it on its path."""
    yield cls, above
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        for child in nested(hints[field.name]):
            if child not in above and child is not cls:
                yield from walk(child, (*above, cls))


def test_no_two_classes_declare_the_same_setting():
    declared: dict[tuple[str, str], set[str]] = {}
    for root in ROOTS:
        for cls, _ in walk(root):
            for field in dataclasses.fields(cls):
                owner = declarer(cls, field.name).__qualname__
                if (field.name, owner) not in DISTINCT:
                    key = (field.name, field.metadata.get("help", ""))
                    declared.setdefault(key, set()).add(owner)
    twice = {key: owners for key, owners in declared.items() if len(owners) > 1}
    assert not twice, f"declared in several classes (name, help) -> classes: {twice}"


def test_no_section_repeats_a_setting_of_a_section_above_it():
    repeated = []
    for root in ROOTS:
        for cls, above in walk(root):
            names = {f.name for f in dataclasses.fields(cls)}
            for parent in above:
                for name in names & {f.name for f in dataclasses.fields(parent)}:
                    if (name, cls.__qualname__) not in DISTINCT:
                        repeated.append(f"{parent.__qualname__} and {cls.__qualname__}: {name}")
    assert not repeated, repeated


def test_the_walk_reaches_every_section():
    reached = {cls.__qualname__ for root in ROOTS for cls, _ in walk(root)}
    assert {"CreditConfig", "LossConfig", "Budget", "SFTConfig", "MethodConfig",
            "TaskSourceConfig", "VLLMConfig"} <= reached
