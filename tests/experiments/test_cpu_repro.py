"""The main job's CI-sized variant, end to end: what RL did to the held-out reward, against
an lr-0 control; and how a stopped run resumes (trainer.resume=true): the warm start it
finished, each arm from its own latest checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from selfcest.configure import ConfigError
from selfcest.experiments import common, cpu_repro
from selfcest.experiments.common import (
    check_resume,
    compose,
    evaluation_splits,
    held_out,
    load_policy,
    train_arm,
    warm_start_folder,
)
from selfcest.experiments.cpu_repro import monolithic_twin, run, validation_score
from selfcest.train.config import validate


@pytest.mark.slow
def test_quick_reproduction_reports_what_rl_did_against_an_lr0_control(tmp_path):
    """The whole pipeline, with the held-out difference's verdict read off its interval. The
    size or sign of the gain is not asserted: it changed with the kernels and the RL seed
    (docs/cpu_reproduction.md, quick variant). What is asserted is that the difference is
    RL's doing: the clone arm retrained at lr 0 from the same warm start measures exactly 0
    on the same tasks, so nothing else (sampling, seeding) moves it."""
    config = compose("cpu_repro_quick", [f"trainer.output_dir={tmp_path}", "log.progress=false"])
    outcome = run(config, log=lambda message: None)

    clones = json.loads((tmp_path / "heldout.json").read_text())["clones"]
    control = compose("cpu_repro_quick", [f"trainer.output_dir={tmp_path / 'control'}",
                                          "log.progress=false", "trainer.lr=0"])
    still, _ = train_arm(control, tmp_path / "sft", tmp_path / "control")
    tasks = evaluation_splits(control, control.eval)["in-distribution"]
    sft = load_policy(control, tmp_path / "sft")
    unchanged = held_out(control, still, tasks, control.eval).difference(
        held_out(control, sft, tasks, control.eval))
    assert unchanged["difference"] == 0.0 and unchanged["reward"] == clones["start"]

    report = (tmp_path / "report.md").read_text()
    assert "| arm | reward after RL | SFT start |" in report
    verdict = ("gains" if clones["low"] > 0 else "loses" if clones["high"] < 0
               else "no resolved change")
    (row,) = [line for line in report.splitlines() if line.startswith("| clones | ")
              and f"{clones['difference']:+.3f} [" in line]
    assert f"| {verdict}" in row, (clones, row)
    assert "| method | budget |" in report  # the evaluation table
    # clones/policy: the clone arm, which the README's notebook snippet loads.
    for name in ("clones/policy/model.safetensors", "eval/pareto_total_tokens.png",
                 "eval/pareto_critical_path.png", "training_curves.png", "eval/trace.html",
                 "eval/results.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert set(outcome["timings"]) >= {"warm start (SFT)", "GRPO, clones", "GRPO, monolithic",
                                       "total"}


@pytest.mark.parametrize("strategy", ["sibling", "counterfactual"])
def test_the_monolithic_twin_of_a_clone_credit_config_runs_with_broadcast_credit(strategy):
    """A strategy that needs clones would make the twin's config invalid (it spawns none): the
    twin gets broadcast credit, which gives a lone root its advantage as every strategy does,
    and `run` validates it before any compute."""
    config = compose("smollm_chain_sum", [f"algo.credit.strategy={strategy}"])
    twin = monolithic_twin(config)
    validate(twin)
    assert (twin.rollout.budget.max_depth, twin.algo.credit.strategy) == (0, "broadcast")
    assert config.algo.credit.strategy == strategy  # the clone arm keeps its own


def test_a_finished_arm_resumed_trains_nothing_and_keeps_its_history(tiny_cpu_repro, tmp_path):
    config = tiny_cpu_repro(tmp_path)
    start = config.warm_start.policy
    _, history = train_arm(config, start, tmp_path / "arm", log=lambda message: None)
    written = {path: path.stat().st_mtime_ns for path in (tmp_path / "arm").rglob("*.safetensors")}

    messages = []
    resumed = tiny_cpu_repro(tmp_path, "trainer.resume=true", "eval.tasks_per_split=8")
    _, again = train_arm(resumed, start, tmp_path / "arm", log=messages.append)
    # eval.* changes nothing trained
    assert messages == [f"resuming {tmp_path / 'arm'} from step_000002"]
    assert {path: path.stat().st_mtime_ns for path in written} == written  # no step, no save
    assert [row["reward/mean"] for row in again] == [row["reward/mean"] for row in history]


def test_a_stopped_arm_trains_the_steps_it_had_left(tiny_cpu_repro, tmp_path):
    straight = train_arm(tiny_cpu_repro(tmp_path / "straight"),
                         tiny_cpu_repro(tmp_path).warm_start.policy,
                         tmp_path / "straight", log=lambda message: None)[1]
    one_step = tiny_cpu_repro(tmp_path, "trainer.steps=1")
    train_arm(one_step, one_step.warm_start.policy, tmp_path / "arm", log=lambda message: None)

    messages = []
    resumed = tiny_cpu_repro(tmp_path, "trainer.resume=true",
                             "trainer.resume_changes=[trainer.steps]")
    _, history = train_arm(resumed, resumed.warm_start.policy, tmp_path / "arm",
                           log=messages.append)
    assert messages == [f"resuming {tmp_path / 'arm'} from step_000001; its config differed in "
                        "trainer.steps"]
    assert [row["step"] for row in history] == [1, 2]
    # The run resumed after step 1 samples and scores what the straight run did at step 2.
    assert json.dumps(history[1]["reward/mean"]) == json.dumps(straight[1]["reward/mean"])


def test_a_checkpoint_path_cannot_resume_every_run_of_an_experiment(tiny_cpu_repro, tmp_path):
    with pytest.raises(ConfigError, match="trainer.resume='runs/x/checkpoints/step_000002'.*use "
                                          "trainer.resume=true"):
        check_resume(tiny_cpu_repro(tmp_path, "trainer.resume=runs/x/checkpoints/step_000002"))


def test_a_finished_warm_start_is_reused_when_resuming_and_trained_again_otherwise(
    tiny_cpu_repro, tmp_path):
    fresh = tiny_cpu_repro(tmp_path, "warm_start.policy=null")
    warm_start_folder(fresh, tmp_path / "sft", log=lambda message: None)
    weights = tmp_path / "sft/model.safetensors"
    trained_at = weights.stat().st_mtime_ns

    messages = []
    warm_start_folder(tiny_cpu_repro(tmp_path, "warm_start.policy=null", "trainer.resume=true"),
                      tmp_path / "sft", log=messages.append)
    assert messages == [f"reusing the warm start in {tmp_path / 'sft'}"]
    assert weights.stat().st_mtime_ns == trained_at

    warm_start_folder(fresh, tmp_path / "sft", log=lambda message: None)
    assert weights.stat().st_mtime_ns != trained_at


def test_the_warm_start_is_validated_on_both_arms_and_scored_by_the_weaker(tiny_cpu_repro, tmp_path,
                                                                            monkeypatch):
    """Each arm solves the validation tasks greedily in its own view and budget (the clone
    arm's keys-only prompts with spawning on, the twin's printed lists with it off); the
    score is the weaker arm's accuracy."""
    config = tiny_cpu_repro(tmp_path)
    policy = load_policy(config, config.warm_start.policy)
    depths, prompts, engine = [], [], policy.engine

    def recording_engine(budget, sampling, **kwargs):
        depths.append((budget.max_depth, sampling.temperature))
        return engine(budget, sampling, **kwargs)

    def monolithic_right(trees, tasks, reward_fn):  # the twin right, the clones wrong
        prompts.append([t.prompt for t in tasks])
        for tree in trees:
            tree.correct = depths[-1][0] == 0

    policy.engine = recording_engine
    monkeypatch.setattr(cpu_repro, "score_trees", monolithic_right)
    assert validation_score(config)(policy) == 0.0
    assert depths == [(config.rollout.budget.max_depth, 0.0), (0, 0.0)] and depths[0][0] > 0
    assert len(prompts[0]) == len(prompts[1]) == 2 and prompts[0] != prompts[1]
    assert validation_score(tiny_cpu_repro(tmp_path, "warm_start.validation_tasks=0")) is None


def test_an_experiment_evaluates_a_saved_policy_on_this_processs_gpu_with_the_run_backend(
    tiny_policy, tmp_path,
    monkeypatch):
    """Every experiment loads its saved policies (`load_policy`) where it decodes, this
    process's GPU where there is one ("meta" pretends one here), decoding with the run's
    rollout.backend and its vLLM settings."""
    tiny_policy.save_pretrained(tmp_path / "policy")
    monkeypatch.setattr(common, "default_device", lambda: torch.device("meta"))
    config = compose("cpu_repro_quick", ["rollout.vllm.dtype=float32"])
    config.rollout.backend = "vllm"  # set after validation: vLLM need not be installed to read it
    policy = load_policy(config, tmp_path / "policy")
    assert next(policy.model.parameters()).device == torch.device("meta")
    assert policy.serving.backend == "vllm" and policy.serving.vllm.dtype == "float32"
