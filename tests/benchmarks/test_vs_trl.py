"""benchmarks/vs_trl.py: the workload both libraries run (default suite), and the whole
comparison at its shortest (marked ``trl``: needs .venv-trl, ``bash scripts/setup_trl_env.sh``)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import REPO, commands, load_module, readme_blocks, shell
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfcest.cli import register_schemas
from selfcest.configure import compose
from selfcest.train.config import TrainConfig
from selfcest.train.setup import build_trainer

# The README's lines: the environment's setup, then the benchmark.
SETUP, COMMAND = commands(readme_blocks("### Against TRL")[0])


vs_trl = load_module("benchmarks/vs_trl.py", "vs_trl")


def test_reward_is_the_digit_share_plus_one_for_the_sum_as_a_whole_number():
    assert vs_trl.reward("", "7") == 0.0
    assert vs_trl.reward("no digits", "7") == 0.0
    assert vs_trl.reward("12", "12") == 2.0
    assert vs_trl.reward("It is 15.", "15") == pytest.approx(2 / 9 + 1)
    assert vs_trl.reward("115", "15") == 1.0  # 15 inside 115 is not the sum
    assert vs_trl.reward("7 and 8", "15") == pytest.approx(2 / 7)


def test_prompts_are_64_additions_with_their_sums():
    pairs = vs_trl.prompts()
    assert len(pairs) == 64 and pairs == vs_trl.prompts()
    for prompt, answer in pairs:
        a, b = map(int, re.fullmatch(r"Add (\d+) and (\d+)\.", prompt).groups())
        assert answer == str(a + b)


def test_workload_folder_feeds_selfcest_the_prompts_and_tokens_trl_reads(tmp_path):
    """The saved model has the stated size and no protocol tokens; selfcest's trainer, built
    from the benchmark's overrides, draws each step the prompts TRL reads from the schedule,
    and renders them to the token ids TRL's chat template gives."""
    steps = 9  # past one epoch of the 64 prompts
    vs_trl.build_workload(tmp_path, ["small"], steps)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "small")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.25e6, rel=0.01)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "small")
    assert "<spawn>" not in tokenizer.get_vocab() and tokenizer.chat_template
    schedule = [json.loads(line) for line in (tmp_path / "schedule.jsonl").read_text().splitlines()]
    assert len(schedule) == steps * vs_trl.PROMPTS_PER_STEP

    register_schemas()
    config = compose("train",
                     vs_trl.selfcest_overrides(tmp_path, "small", 0.04, steps, tmp_path / "run"),
                     TrainConfig)
    assert config.algo.loss.aggregation == "token_mean" and config.algo.credit.std_normalize
    assert config.algo.loss.kl_coef == 0.04 and config.rollout.budget.max_depth == 0
    trainer = build_trainer(config)
    try:
        drawn = [task for _ in range(steps)
                 for task in trainer.sampler.take(vs_trl.PROMPTS_PER_STEP)]
        assert [(t.prompt, t.answer) for t in drawn] == [(r["prompt"], r["answer"])
                                                         for r in schedule]
        for task in drawn[: vs_trl.PROMPTS_PER_STEP]:
            chat = tokenizer.apply_chat_template([{"role": "user", "content": task.prompt}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)
            assert trainer.policy.protocol.root_prompt(task) == list(chat["input_ids"])
    finally:
        trainer.close()


def test_weights_digest_sees_one_ulp_in_any_tensor():
    """Two models initialised alike digest alike; one weight moved by one ulp, in the first
    tensor, the last layer or the final norm, changes the digest."""
    build = lambda: vs_trl.random_qwen2("small", 64, pad_token_id=0, eos_token_id=1)  # noqa: E731
    model, twin = build(), build()
    digest = vs_trl.weights_digest(model)
    assert len(digest) == 32 and vs_trl.weights_digest(twin) == digest
    inner = model.model  # the output layer is the embedding, tied
    for tensor in (inner.embed_tokens.weight, inner.layers[-1].mlp.down_proj.weight,
                   inner.norm.weight):
        with torch.no_grad():
            flat = tensor.view(-1)
            kept = flat[-1].clone()
            flat[-1] = torch.nextafter(kept, kept + 1)
            assert vs_trl.weights_digest(model) != digest
            flat[-1] = kept
        assert vs_trl.weights_digest(model) == digest


def test_first_drift_names_the_first_run_and_step_whose_weights_differ():
    alike = [[{"weights": w} for w in "abc"] for _ in range(3)]
    assert vs_trl.first_drift(alike) is None and vs_trl.first_drift(alike[:1]) is None
    late = [list(run) for run in alike]
    late[2][1] = {"weights": "x"}
    assert vs_trl.first_drift(late) == (2, 1)
    early = [list(run) for run in late]
    early[1][2] = {"weights": "y"}
    assert vs_trl.first_drift(early) == (1, 2)
    first = [list(run) for run in alike]
    first[1][0] = {"weights": "z"}
    assert vs_trl.first_drift(first) == (1, 0)


@pytest.mark.trl
def test_benchmark_prints_the_ratio_rows_at_its_shortest(tmp_path):
    """One pair of runs of two steps on the small model, both betas; load is not what this
    checks, so no run is discarded for it."""
    assert SETUP == "bash scripts/setup_trl_env.sh" and SETUP in (REPO / ".ci/run").read_text()
    if not (REPO / ".venv-trl/bin/python").exists():
        pytest.skip(".venv-trl is missing: run bash scripts/setup_trl_env.sh")
    command = (f"{COMMAND} --model small --steps 2 --pairs 1 --max-other-load inf --workdir "
               f"{tmp_path}"
               " --selfcest-set trainer.share_prompt_forward=false")
    done = shell(command, REPO)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    number = r"\s+\d+\.\d+"
    for beta in ("0.00", "0.04"):
        # TRL, selfcest, ratio
        assert re.search(rf"^small\s+{beta}{number * 3}", done.stdout, re.MULTILINE), done.stdout
        for library in ("TRL", "selfcest"):
            assert re.search(rf"^small\s+{beta}\s+{library}{number}", done.stdout,
                             re.MULTILINE), done.stdout
    assert "4 runs kept, 0 discarded" in done.stdout
    configs = [json.loads(path.read_text())
               for path in (tmp_path / "runs").glob("selfcest-*/config.json")]
    assert len(configs) == 2 and all(c["trainer"]["share_prompt_forward"] is False for c in configs)
    # Each library's runs are compared by the weights after every step.
    for beta in ("0.0", "0.04"):
        for library in ("TRL", "selfcest"):
            assert re.search(rf"^small beta={beta}\s+{library}\s+1 run\(s\): alike at every step$",
                             done.stdout,
                             re.MULTILINE), done.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    runs = [[step["weights"] for step in run] for by_library in results.values()
            for library_runs in by_library.values()
            for run in library_runs]
    assert len(runs) == 4 and all(re.fullmatch(r"[0-9a-f]{32}", d) for run in runs for d in run)
    assert all(len(run) == len(set(run)) == 2 for run in runs)  # every step moved the weights
