"""Hydra configs and CLIs: the shipped configs compose, bad ones fail before compute."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fill_missing
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from selfcest.algo.losses import LossConfig, aggregation_weights
from selfcest.cli import register_schemas
from selfcest.configure import CONFIG_DIR, ConfigError, build
from selfcest.train.config import TrainConfig, held_out_splits, load_split, validate
from selfcest.train.setup import build_reward, build_trainer

register_schemas()
EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def train_config(*overrides: str):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return build(TrainConfig, compose("train", overrides=list(overrides)))


def test_default_config_is_valid_and_typed():
    config = train_config()
    validate(config)
    assert config.model.name == "tiny" and config.rollout.budget.max_depth == 1
    assert config.algo.credit.strategy == "broadcast"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_composes(experiment, tmp_path):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    # GPU experiments take the model and data paths on the command line.
    required = fill_missing(cfg, str(tmp_path))
    assert all(k == "model.name" or "path" in k for k in required), required
    config = build(TrainConfig, cfg)
    validate(config)
    assert callable(build_reward(config))  # the reward spec and its parameters load
    # Every tree weighs the same in the loss, however many clones it has (configs/algo/grpo.yaml).
    assert config.algo.loss.aggregation == "tree_mean"


@pytest.mark.parametrize("mode, split", [("tree_mean", (0.5, 0.5)), ("token_mean", (0.9, 0.1)),
                                         ("seq_mean_token_mean", (0.9, 0.1))])
def test_gradient_mass_of_a_tree_with_eight_clones_and_one_without(mode, split):
    """100 trainable tokens a node: tree 0 has a root and 8 clones, tree 1 a root alone."""
    lengths, trees = [100] * 10, [0] * 9 + [1]
    weights = aggregation_weights(lengths, trees, mode)
    mass = [sum(w * n for w, n, t in zip(weights, lengths, trees) if t == tree) for tree in (0, 1)]
    assert mass == pytest.approx(list(split))


def test_the_default_aggregation_weighs_every_tree_the_same():
    assert train_config().algo.loss.aggregation == "tree_mean" == LossConfig().aggregation


def test_grpo_plain_is_the_textbook_group_normalised_token_mean_grpo():
    """algo=grpo_plain: A = (r - mean) / (sample std + 1e-4) for every tree, ties kept (A = 0),
    every completion token of the batch weighing the same."""
    from selfcest.algo.advantages import compute_advantages
    from selfcest.tree import CloneTree, Node

    algo = train_config("algo=grpo_plain").algo
    trees = []
    for task_index, rewards in enumerate([[1.0, 0.0, 0.5, 0.5], [0.3, 0.3, 0.3, 0.3]]):
        for sample, reward in enumerate(rewards):
            tree = CloneTree(task_id=str(task_index), task_index=task_index, sample_index=sample)
            tree.add(Node(id="0", parent_id=None, depth=0, objective=None, prompt_ids=[1]))
            tree.reward, tree.correct, tree.info["malformed_nodes"] = reward, False, []
            trees.append(tree)
    advantages = compute_advantages(trees, algo.credit)
    std = statistics.stdev([1.0, 0.0, 0.5, 0.5])
    expected = [(r - 0.5) / (std + 1e-4) for r in [1.0, 0.0, 0.5, 0.5]] + [0.0] * 4
    assert [a["0"] for a in advantages.per_tree] == pytest.approx(expected)
    assert all(advantages.keep)
    assert aggregation_weights([3, 1, 4], [0, 0, 1],
                               algo.loss.aggregation) == pytest.approx([1 / 8] * 3)
    assert (algo.loss.kl_coef, algo.loss.clip_low, algo.loss.clip_high,
            algo.loss.dual_clip) == (0, 0.2, 0.2, None)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.budget.node_context=0", "rollout.budget.node_context must be >= 1"),
        ("rollout.budget.node_generation=5000", "rollout.budget.node_generation (5000) exceeds"),
        ("algo.credit.strategy=magic", "algo.credit.strategy must be one of broadcast, ratio, "
                                       "sibling, counterfactual; got 'magic'"),
        # max_tokens 0
        ("rollout.budget.node_generation=0", "rollout.budget.node_generation must be >= 1, got 0"),
        ("trainer.trees_per_prompt=-4", "trainer.trees_per_prompt must be >= 2"),
        ("task.reward_timeout_s=0",
         "task.reward_timeout_s must be a number of seconds > 0, or null; got 0"),
        ("trainer.max_nonfinite_updates=0",
         "trainer.max_nonfinite_updates must be a number >= 1; got 0"),
        ("algo.loss.clip_low=1.5", "algo.loss.clip_low must be < 1"),
        ("model=hf", "model.name is required"),
        ("model.name=/no/such/model", "model.name must be one of"),
        ("trainer.trees_per_prompt=1", "trainer.trees_per_prompt must be >= 2"),
        ("trainer.tokens_per_micro_batch=100", "trainer.tokens_per_micro_batch (100) is smaller"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(train_config(override))


def test_unknown_keys_wrong_types_and_choices_are_rejected_at_composition():
    for override in ("algo.loss.aggregation=sum", "trainer.schedule=step"):  # choices are enums
        with pytest.raises(ConfigCompositionException, match=override):
            train_config(override)
    with pytest.raises(ConfigCompositionException, match="trainer.foo"):
        train_config("trainer.foo=1")
    with pytest.raises(ConfigError, match="unknown key trainer.foo"):
        train_config("+trainer.foo=1")  # Hydra lets an appended key through; we do not
    with pytest.raises(ConfigCompositionException, match="trainer.steps=abc"):
        train_config("trainer.steps=abc")


def test_reward_that_cannot_load_stops_before_any_model(tmp_path):
    config = train_config("task.reward=no.such.module:reward", f"trainer.output_dir={tmp_path}")
    with pytest.raises(ConfigError, match="task.reward: reward spec 'no.such.module:reward'"):
        build_trainer(config)
    assert not (tmp_path / "metrics.jsonl").exists()


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(CONFIG_DIR.parent)}  # this checkout's selfcest
    return subprocess.run([sys.executable, "-m", "selfcest.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_train_cli_runs_and_config_errors_exit_2(tmp_path):
    ok = run_cli("trainer.steps=1", "trainer.prompts_per_step=2",
                 f"trainer.output_dir={tmp_path}/run",
                 "log.progress=false", "rollout.budget.node_generation=8",
                 "rollout.budget.tree_generation=16",
                 cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    bad = run_cli("rollout.budget.node_context=0", cwd=tmp_path)
    assert bad.returncode == 2
    assert "configuration error: rollout.budget.node_context must be >= 1" in bad.stderr
    typo = run_cli("trainer.stpes=3", f"trainer.output_dir={tmp_path}/typo", cwd=tmp_path)
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1, typo.stderr
    assert typo.stderr.startswith("selfcest: configuration error: unknown key trainer.stpes (did "
                                  "you mean trainer.steps?); the keys of trainer: betas, "
                                  "collective_timeout_s, cpu_threads, ")
    assert not (tmp_path / "typo").exists()  # stopped before Hydra made the folder


# ------------------------------------------------------------------ task keys


@pytest.mark.parametrize("group", sorted(p.stem for p in (CONFIG_DIR / "task").glob("*.yaml")))
def test_a_task_group_gets_its_own_params_and_nothing_else(group):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"task={group}"])
    own = OmegaConf.load(CONFIG_DIR / "task" / f"{group}.yaml")
    for key in ("params", "eval_params"):  # nothing merged in from the schema's defaults
        assert OmegaConf.to_container(cfg.task[key]) == OmegaConf.to_container(own[key]), key


def task_file(tmp_path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "p", "answer": "7"}) + "\n")
    return path


def task_config(tmp_path, *overrides: str):
    """A config whose required task paths are one small task file."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    fill_missing(cfg, str(task_file(tmp_path)))
    return build(TrainConfig, cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+task.params.split=train"], "task.params.split: task source 'jsonl' takes no 'split' "
                                       "(it takes path, max_line_bytes); remove it"),
        (["+task.eval_params.split=test"],
         "task.eval_params.split: task source 'jsonl' takes no 'split'"),
        (["task.params.path=/no/such.jsonl"],
         "task.params.path: no file or folder '/no/such.jsonl'"),
        (["task=arithmetic", "task.params.n_train=abc"],
         "task.params.n_train must be int; got 'abc'"),
        (["task=arithmetic", "+task.eval_params.seed=1.5"],
         "task.eval_params.seed must be int; got 1.5"),
        (["task.name=nope"], "task.name must be one of keyed_sum, arithmetic"),
        (["task=mixed", "task.params.sources.math_hard.params.path=/no/such.jsonl"],
         "task.params.sources.math_hard.params.path: no file or folder"),
        (["task=mixed", "task.params.sources.aime.repeat=0"],
         "task.params.sources.aime.repeat must be a whole number >= 1"),
        (["task=mixed", "+task.params.sources.aime.params.split=train"],
         "task.params.sources.aime.params.split: task source 'jsonl' takes no 'split'"),
    ],
)
def test_bad_task_keys_name_the_key_and_the_fix(overrides, message, tmp_path):
    config = task_config(tmp_path, "task=jsonl", *overrides)
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_task_file_that_cannot_be_read_names_its_key(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"id": "b", "prompt": "p"}\n')
    config = task_config(tmp_path, "task=jsonl", f"task.eval_params.path={tmp_path / 'bad.jsonl'}")
    validate(config)
    assert load_split(config.task, "train")[0].answer == "7"
    with pytest.raises(ConfigError,
                       match=r"task.eval_params \(jsonl\): .*bad.jsonl line 1: missing fields"):
        load_split(config.task, "eval")
    config = train_config("task=keyed_sum", "task.eval_params.split=dev")
    with pytest.raises(ConfigError, match=r"task.eval_params \(keyed_sum\): split must be one of "
                                          r"train, test, ood"):
        load_split(config.task, "eval")


def test_the_command_line_turns_a_groups_ood_split_off_with_null():
    """{} would merge into the group's overrides and keep the split; null removes it."""
    assert held_out_splits(train_config("experiment=smollm_chain_sum").task) == ["eval", "ood"]
    assert held_out_splits(train_config("experiment=smollm_chain_sum",
                                        "task.ood_params={}").task) == ["eval", "ood"]
    config = train_config("experiment=smollm_chain_sum", "task.ood_params=null")
    validate(config)
    assert held_out_splits(config.task) == ["eval"]


@pytest.mark.paper  # a Python start-up: with the paper runs
def test_a_paper_command_with_a_key_its_task_does_not_take_exits_2_in_one_line(tmp_path):
    path = task_file(tmp_path)
    bad = run_cli("experiment=paper_aime", "model.name=tiny", f"task.params.path={path}",
                  f"task.eval_params.path={path}", "+task.params.split=train", cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1] == (
        "selfcest: configuration error: task.params.split: task source 'jsonl' takes no 'split' "
        "(it takes path, max_line_bytes); remove it")
    assert "Traceback" not in bad.stderr
