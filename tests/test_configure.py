"""Typed configuration: one validation that names the full key, help for every setting."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from selfcest.budget import Budget
from selfcest.cli import register_schemas
from selfcest.configure import (
    CONFIG_DIR,
    ConfigError,
    build,
    check_overrides,
    compose,
    describe,
    validate,
)
from selfcest.eval.config import EvalConfig
from selfcest.train.config import ProtocolName, TrainConfig


def test_an_error_inside_a_section_is_named_by_its_own_path():
    with pytest.raises(ConfigError, match=r"^warm_start\.budget\.node_context must be >= 1"):
        build(TrainConfig, {"warm_start": {"budget": {"node_context": 0}}})
    with pytest.raises(ConfigError, match=r"^rollout\.budget\.node_context must be >= 1"):
        build(TrainConfig, {"rollout": {"budget": {"node_context": 0}}})
    with pytest.raises(ConfigError, match=r"^algo\.credit\.eps must be a positive"):
        build(TrainConfig, {"algo": {"credit": {"eps": 0.0}}})
    with pytest.raises(ConfigError, match=r"^unknown key warm_start\.sft\.stepz"):
        build(TrainConfig, {"warm_start": {"sft": {"stepz": 3}}})


def test_validate_names_the_path_of_a_config_changed_in_python():
    config = TrainConfig()
    config.warm_start.budget = Budget()
    config.warm_start.budget.node_context = 0
    with pytest.raises(ConfigError, match=r"^warm_start\.budget\.node_context must be >= 1"):
        validate(config)


def test_choices_given_as_strings_become_enum_members_or_fail_with_the_choices():
    config = TrainConfig()
    config.model.protocol = "tool"
    validate(config)
    assert config.model.protocol is ProtocolName.tool
    config.model.protocol = "morse"
    with pytest.raises(ConfigError,
                       match=r"^model\.protocol must be one of token, tool, none; got 'morse'"):
        validate(config)


def test_cross_section_checks_name_both_keys():
    config = TrainConfig()
    config.algo.credit.strategy = "sibling"
    config.rollout.budget.max_depth = 0
    with pytest.raises(ConfigError,
                       match=r"algo\.credit\.strategy=sibling needs clones.*max_depth=0"):
        validate(config)


def test_protocol_none_composes_and_refuses_credit_that_needs_clones():
    """model.protocol=none is the string "none", not null; it spawns nothing whatever the
    budget says, so the default max_depth passes, but credit over clones does not."""
    register_schemas()
    config = compose("train", ["model.protocol=none", "algo=grpo_plain"], TrainConfig)
    assert config.model.protocol is ProtocolName.none and config.rollout.budget.max_depth > 0
    config.algo.credit.strategy = "counterfactual"
    with pytest.raises(ConfigError, match=r"^algo\.credit\.strategy=counterfactual needs clones, "
                                          r"but model\.protocol=none .*use "
                                          r"algo\.credit\.strategy=broadcast"):
        validate(config)


def leaves(kind: type, path: str = ""):
    hints = typing.get_type_hints(kind)
    for f in dataclasses.fields(kind):
        yield f"{path}{f.name}", f
        inner = [t for t in (hints[f.name], *typing.get_args(hints[f.name]))
                 if dataclasses.is_dataclass(t)]
        if inner:
            yield from leaves(inner[0], f"{path}{f.name}.")


@pytest.mark.parametrize("kind", [TrainConfig, EvalConfig])
def test_every_setting_is_declared_with_its_help(kind):
    missing = [key for key, f in leaves(kind) if not f.metadata.get("help")]
    assert missing == []
    lines = describe(kind)
    assert len(lines) == len(list(leaves(kind)))


def test_selfcest_train_help_prints_every_key():
    result = subprocess.run([sys.executable, "-m", "selfcest.train", "--help"], capture_output=True,
                            text=True, cwd=CONFIG_DIR.parent, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("selfcest-train [key=value ...]")
    assert ("\nrollout.budget.node_context (int, default 1024): tokens one node's context may "
            "hold") in result.stdout
    assert ("\nalgo.loss.aggregation (token_mean | seq_mean_token_mean | tree_mean, default "
            "'tree_mean')") in result.stdout


def test_compose_works_inside_a_running_hydra_app():
    """A sweep (a Hydra app) composes each run's config; the app's Hydra stays as it was."""
    register_schemas()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        outer = GlobalHydra.instance().hydra
        config = compose("train", ["experiment=controller_quick"], TrainConfig)
        assert config.name == "controller_quick"
        assert GlobalHydra.instance().hydra is outer


@pytest.mark.parametrize("override, message", [
    ("trainer.stpes=3",
     "unknown key trainer.stpes (did you mean trainer.steps?); the keys of trainer: betas, "),
    ("+trainer.stpes=3", "unknown key trainer.stpes (did you mean trainer.steps?)"),
    ("rollout.budgt.node_generation=0", "unknown key rollout.budgt (did you mean rollout.budget?)"),
    ("trainer.steps.x=1",
     "trainer.steps is a setting, not a section: trainer.steps.x names nothing"),
    ("algo.loss.aggregation=sum", "algo.loss.aggregation must be one of token_mean, "
                                  "seq_mean_token_mean, tree_mean; got 'sum'"),
])
def test_a_typo_on_the_command_line_names_the_key_and_what_it_may_be(override, message):
    with pytest.raises(ConfigError) as error:
        check_overrides(TrainConfig, [override])
    assert str(error.value).startswith(message)


def test_groups_hydra_keys_free_form_mappings_and_interpolations_pass_to_hydra():
    check_overrides(TrainConfig,
                    ["model=tiny", "experiment=cpu_repro", "hydra.verbose=true", "--multirun",
                     "task.params.n_train=4", "+task.params.anything.deep=1", "eval.budgets=[1,2]",
                     "algo.credit.strategy=${oc.env:STRATEGY}", "model.lora=null",
                     "trainer.schedule=cosine"])
