"""selfcest's GRPO step against TRL's `GRPOTrainer`, on one identical workload.

Both libraries train the same random Qwen2 (loaded from one saved folder) on the same 64
prompts ``Add {a} and {b}.`` (chat messages, one user turn; the same prompts in the same
order every step), with the same reward (the fraction of the completion's characters that
are digits, plus 1 if the correct sum appears in it as a number) and the same GRPO: 8
prompts x 4 completions a step, at most 64 new tokens, temperature 1, AdamW at a constant
lr of 1e-4, gradient clip 1.0, fp32, rewards normalised by the group's std, the loss the
mean over all completion tokens of the batch, one optimizer step per generation batch, and
beta 0 or 0.04 (k3 KL to the initial weights). Models: ``small`` (1.25M parameters: hidden
128, 6 layers) and ``large`` (8.49M: hidden 256, 10 layers), with selfcest's in-memory
byte-level BPE tokenizer (492 tokens: its small corpus has no more merges for 2048).

    python benchmarks/vs_trl.py [--model small large] [--beta 0 0.04] [--steps 8] [--pairs 3]
                                [--selfcest-set KEY=VALUE ...]

Needs TRL's own environment (``bash scripts/setup_trl_env.sh``: .venv-trl). Each run is a
process of its own, selfcest (this Python) and TRL (.venv-trl, which cannot import
selfcest) alternating, ``--pairs`` of each per model and beta. A run that overlapped other
load on the machine (more than ``--max-other-load`` cores on average, from /proc/stat) is
discarded and run again. Prints, per model and beta: the seconds per step of each library
(the median over runs of each run's median step, the first step left out as warm-up), the
ratio selfcest / TRL, the mean reward of the first and last step, then each library's
phase split, and whether each library's repeated runs trained bitwise the same weights
after every step (they share one seed). Every run's steps go to ``<workdir>/results.json``.
``--selfcest-set`` adds Hydra overrides to selfcest's runs
(``trainer.share_prompt_forward=false``: selfcest as it was before it shared prompts), to
compare a setting against the same TRL baseline.

Reports ratios, not absolute speeds: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEED = 0
VOCAB = 2048  # asked of the tokenizer trainer, which stops at 492
MODELS = {  # name: (hidden, layers, heads, kv heads, intermediate)
    "small": (128, 6, 4, 2, 384),  # 1.25M parameters
    "large": (256, 10, 8, 4, 832),  # 8.49M parameters
}
PROMPTS = 64
PROMPTS_PER_STEP = 8
GROUP = 4
MAX_NEW_TOKENS = 64
LR = 1e-4
PHASES = ("rollout", "scoring", "reference", "training", "forward", "backward", "optimizer")
# One step of a run: seconds by phase, mean reward and completion length, and "weights"
# (`weights_digest` of the weights after the step).
Step = dict[str, float | str]


# ----------------------------------------------------------------------------- the workload


def contains_sum(text: str, answer: str) -> bool:
    """Whether ``answer`` appears in ``text`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", text) is not None


def reward(text: str, answer: str) -> float:
    """The fraction of the characters of ``text`` that are digits, plus 1 if the correct
    sum ``answer`` appears in it: the digit share rewards any step towards a number, so a
    random model already has a gradient."""
    digits = sum(c in "0123456789" for c in text) / len(text) if text else 0.0
    return digits + float(contains_sum(text, answer))


def prompts() -> list[tuple[str, str]]:
    """The 64 (prompt, answer) pairs, in a fixed order."""
    rng = random.Random(SEED)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(PROMPTS)]
    return [(f"Add {a} and {b}.", str(a + b)) for a, b in pairs]


def random_qwen2(name: str, vocab_size: int, **token_ids):
    """The random Qwen2 of ``MODELS[name]``, initialised under ``SEED``; ``token_ids``: its
    pad and EOS ids."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv_heads, intermediate = MODELS[name]
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=True, **token_ids,
    )
    torch.manual_seed(SEED)
    return Qwen2ForCausalLM(config)


def build_workload(folder: Path, models: list[str], steps: int) -> None:
    """Write what both libraries read: each model with its tokenizer (``<model>/``), the
    tasks as selfcest reads them (``tasks.jsonl``) and the prompts of every step in the
    order selfcest's task sampler draws them (``schedule.jsonl``), which TRL reads unshuffled."""
    from transformers.utils import logging

    from selfcest.policy import build_tokenizer
    from selfcest.task import Task
    from selfcest.tasks import write_jsonl
    from selfcest.train.trainer import TaskSampler

    logging.disable_progress_bar()
    tokenizer = build_tokenizer(vocab_size=VOCAB, protocol_tokens=False)
    for name in models:
        model = random_qwen2(name, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    tasks = [Task(id=f"add{i}", prompt=p, answer=a) for i, (p, a) in enumerate(prompts())]
    write_jsonl(tasks, folder / "tasks.jsonl")
    drawn = TaskSampler(tasks, SEED).take(steps * PROMPTS_PER_STEP)
    rows = [json.dumps({"prompt": task.prompt, "answer": task.answer}) + "\n" for task in drawn]
    (folder / "schedule.jsonl").write_text("".join(rows))


# ----------------------------------------------------------------------------- selfcest


def selfcest_overrides(folder: Path, model: str, beta: float, steps: int, out: Path) -> list[str]:
    """The Hydra overrides that make selfcest's `GRPOTrainer` run the workload."""
    tasks = folder / "tasks.jsonl"
    return [
        "algo=grpo_plain", f"algo.loss.kl_coef={beta}",
        "algo.loss.kl_clamp=1e9",  # TRL does not clamp the per-token KL
        # No spawn grammar: no tokens added to the vocabulary, no stop but EOS.
        f"model.name={folder / model}", "model.protocol=none",
        "model.dtype=float32", "model.gradient_checkpointing=false",
        "task=jsonl", f"task.params.path={tasks}", f"task.eval_params.path={tasks}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        "rollout.budget.max_depth=0", f"rollout.budget.node_generation={MAX_NEW_TOKENS}",
        f"trainer.prompts_per_step={PROMPTS_PER_STEP}", f"trainer.trees_per_prompt={GROUP}",
        f"trainer.lr={LR}", "trainer.schedule=constant", "trainer.warmup_steps=0",
        "trainer.weight_decay=0.0", "trainer.max_grad_norm=1.0",
        "trainer.optimizer_steps_per_step=1",
        f"trainer.steps={steps}", f"trainer.seed={SEED}", f"trainer.output_dir={out}",
        "log.progress=false", "log.trees_every=0",
    ]


def selfcest_phases(metrics: dict[str, float]) -> dict[str, float]:
    """One step's seconds by phase, from selfcest's step metrics (the forward, backward,
    optimizer and reference keys where the trainer reports them). The reference forward
    runs inside the update: it is taken out of ``training`` and shown on its own."""
    step = {
        "step": metrics["time/step"],
        "rollout": metrics["time/rollout"],
        "scoring": metrics["time/scoring"],
        "training": metrics["time/training"] + metrics["time/sync"]
        - metrics.get("time/reference", 0.0),
        "reward": metrics["reward/mean"],
        "tokens": metrics["cost/generated_tokens"],
    }
    for phase in ("forward", "backward", "optimizer", "reference"):
        if f"time/{phase}" in metrics:
            step[phase] = metrics[f"time/{phase}"]
    return step


def run_selfcest(folder: Path, model: str, beta: float, steps: int, out: Path,
                 extra: Sequence[str] = ()) -> list[Step]:
    """Build selfcest's trainer as the CLI does (``extra``: overrides added last) and run
    ``steps`` steps; each step's phases and weights."""
    from selfcest.cli import register_schemas
    from selfcest.configure import compose
    from selfcest.rewards.base import RewardResult, final_turn_text
    from selfcest.train.config import TrainConfig
    from selfcest.train.setup import build_trainer

    def reward_fn(tree, task) -> RewardResult:
        text = final_turn_text(tree)
        return RewardResult(score=reward(text, task.answer),
                            correct=contains_sum(text, task.answer))

    register_schemas()
    config = compose("train", selfcest_overrides(folder, model, beta, steps, out) + list(extra),
                     TrainConfig)
    trainer = build_trainer(config, reward_fn=reward_fn)
    try:
        # The digest is taken after the step's clock stopped: it is not part of the step.
        return [{**selfcest_phases(trainer.step()), "weights": weights_digest(trainer.policy.model)}
                for _ in range(steps)]
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- TRL


def trl_config(beta: float, steps: int, out: Path):
    """TRL's `GRPOConfig` for the workload. Its defaults that differ from it are set
    explicitly (bf16 and gradient checkpointing are on by default)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out), seed=SEED, max_steps=steps,
        # One generation batch of 8 prompts x 4 completions is one optimizer step.
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, gradient_accumulation_steps=1,
        num_generations=GROUP, num_iterations=1, shuffle_dataset=False,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        # dapo: the token losses summed over the batch, divided by its completion tokens.
        loss_type="dapo", scale_rewards="group", epsilon=0.2, beta=beta,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, use_vllm=False,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False,
    )


def timed_trl_trainer():
    """TRL's `GRPOTrainer` with the seconds of each phase of a step added up, and each
    finished step's phases, mean reward and weights digest kept in ``steps``."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class StepTimer(TrainerCallback):
        """The step's wall time, from the trainer's own step hooks."""

        def __init__(self, trainer) -> None:
            self.trainer, self.start = trainer, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.trainer.seconds.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.trainer.finish_step(time.perf_counter() - self.start)
            # after the step's clock stopped
            self.trainer.steps[-1]["weights"] = weights_digest(model)

    class TimedGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.seconds: Counter[str] = Counter()
            self.steps: list[Step] = []
            self.add_callback(StepTimer(self))

        @contextlib.contextmanager
        def timed(self, name: str):
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[name] += time.perf_counter() - start

        def _generate(self, *args, **kwargs):
            with self.timed("rollout"):
                return super()._generate(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            with self.timed("generate_and_score"):
                return super()._generate_and_score_completions(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            if model is not self.ref_model:  # None when beta is 0
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            with self.timed("reference"):
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            with self.timed("forward"):
                return super().compute_loss(*args, **kwargs)

        def training_step(self, *args, **kwargs):
            with self.timed("training_step"):
                return super().training_step(*args, **kwargs)

        def finish_step(self, seconds: float) -> None:
            """Record the step in selfcest's phases: rollout (generation), scoring (rewards and
            advantages), reference (the KL reference's forward, which TRL runs while scoring)
            and training (the rest: the loss's forward, the backward, and the optimizer's
            clip, step and zero grad)."""
            s = self.seconds
            self.steps.append({
                "step": seconds,
                "rollout": s["rollout"],
                "scoring": s["generate_and_score"] - s["rollout"] - s["reference"],
                "reference": s["reference"],
                "training": seconds - s["generate_and_score"],
                "forward": s["forward"],
                "backward": s["training_step"] - s["generate_and_score"] - s["forward"],
                "optimizer": seconds - s["training_step"],
                "reward": self._metrics["train"]["reward"][-1],
                "tokens": self._metrics["train"]["completions/mean_length"][-1],
            })

    return TimedGRPOTrainer


def run_trl(folder: Path, model: str, beta: float, steps: int, out: Path) -> list[Step]:
    """TRL's `GRPOTrainer` on the workload for ``steps`` steps; each step's phases and weights."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    schedule = [json.loads(line) for line in (folder / "schedule.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]}
        for row in schedule
    ])

    def digit_reward(completions, answer, **kwargs) -> list[float]:
        return [reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    trainer = timed_trl_trainer()(
        model=AutoModelForCausalLM.from_pretrained(folder / model, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(folder / model),
        reward_funcs=digit_reward, args=trl_config(beta, steps, out), train_dataset=dataset,
    )
    trainer.train()
    return trainer.steps


# ----------------------------------------------------------------------------- measuring


def busy_cpu_seconds() -> float:
    """CPU seconds every process of the machine has used since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds this process's finished child processes have used."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_load: float, patience: float = 60.0) -> None:
    """Wait until, over one second, other processes use at most ``max_load`` cores (or
    ``patience`` seconds have passed: the run is then likely discarded)."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        before = busy_cpu_seconds()
        time.sleep(1.0)
        if busy_cpu_seconds() - before <= max_load:
            return


def run_worker(library: str, folder: Path, model: str, beta: float, steps: int, threads: int,
               log: Path, selfcest_set: Sequence[str] = ()) -> tuple[list[Step], float]:
    """One run in a process of its own; its steps, and the cores other processes used
    meanwhile (the machine's busy CPU time less this run's, over its wall time)."""
    python = sys.executable if library == "selfcest" else str(REPO / ".venv-trl/bin/python")
    result = log.with_suffix(".json")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if library == "trl":
        # The TRL run must not see selfcest at all (.venv-trl does not install it).
        env.pop("PYTHONPATH", None)
    command = [python, __file__, "--worker", library, "--folder", str(folder), "--model", model,
               "--beta", str(beta), "--steps", str(steps), "--threads", str(threads), "--out",
               str(result)]
    if library == "selfcest" and selfcest_set:
        command += ["--selfcest-set", *selfcest_set]
    busy, own, start = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    with open(log, "w") as output:
        done = subprocess.run(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                              check=False)
    wall = time.perf_counter() - start
    other = (busy_cpu_seconds() - busy - (children_cpu_seconds() - own)) / wall
    if done.returncode:
        raise SystemExit(f"{library} run failed (exit {done.returncode}); its output, {log}:\n"
                         + log.read_text()[-3000:])
    return json.loads(result.read_text()), other


def weights_digest(model) -> str:
    """A digest of the bytes of every tensor in ``model``'s state dict: equal after a step
    in two runs exactly when they trained bitwise the same weights (up to a hash collision)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy())
    return digest.hexdigest()


def first_drift(runs: list[list[Step]]) -> tuple[int, int] | None:
    """The first (run, step), counted from 0, after which a run's weights differ from the
    first run's; None when every run trained bitwise the same weights at every step."""
    for run, steps in enumerate(runs[1:], start=1):
        for step, (theirs, ours) in enumerate(zip(runs[0], steps)):
            if theirs["weights"] != ours["weights"]:
                return run, step
    return None


def summary(runs: list[list[Step]]) -> dict[str, float]:
    """Median over runs of each run's median step (first step left out), per phase; the
    mean reward of the first and the last step, over runs; the mean completion length."""
    measured = [steps[1:] or steps for steps in runs]
    keys = [k for k in ("step", *PHASES) if all(k in s for steps in measured for s in steps)]
    out = {k: statistics.median(statistics.median(s[k] for s in steps) for steps in measured)
           for k in keys}
    out["tokens"] = statistics.fmean(s["tokens"] for steps in runs for s in steps)
    out["reward_first"] = statistics.fmean(steps[0]["reward"] for steps in runs)
    out["reward_last"] = statistics.fmean(steps[-1]["reward"] for steps in runs)
    return out


def print_tables(results: dict[tuple[str, float], dict[str, dict[str, float]]]) -> None:
    """The comparison (step time, ratio, reward) and each library's phase split, per model
    and beta."""
    print(f"\n{'model':6s} {'beta':>5s} {'TRL s/step':>11s} {'selfcest s/step':>16s} "
          f"{'selfcest/TRL':>13s}  {'reward TRL':>12s}  {'reward selfcest':>15s}   (reward: mean "
          "of the first -> last step)")
    for (model, beta), by_library in results.items():
        trl, ours = by_library["trl"], by_library["selfcest"]
        print(f"{model:6s} {beta:5.2f} {trl['step']:11.3f} {ours['step']:16.3f} "
              f"{ours['step'] / trl['step']:13.2f}  "
              f"{trl['reward_first']:5.3f}->{trl['reward_last']:<5.3f}  "
              f"{ours['reward_first']:8.3f}->{ours['reward_last']:<5.3f}")
    print("\nphase split, s/step (median of run medians); tokens: mean completion length")
    print(f"{'model':6s} {'beta':>5s} {'library':9s}"
          + "".join(f"{p:>10s}" for p in (*PHASES, "tokens")))
    for (model, beta), by_library in results.items():
        for library in ("trl", "selfcest"):
            row = by_library[library]
            cells = "".join(f"{row[p]:10.3f}" if p in row else f"{'-':>10s}" for p in PHASES)
            print(f"{model:6s} {beta:5.2f} "
                  f"{'TRL' if library == 'trl' else library:9s}{cells}{row['tokens']:10.1f}")
    print("rollout: generation; scoring: rewards and advantages; reference: the KL reference's "
          "forward (TRL's while scoring, selfcest's in its update);\ntraining: the update, less "
          "the reference where reported (forward: the loss's forward pass; optimizer: clip, step, "
          "zero grad); -: not reported")


def print_repeats(all_runs: dict[str, dict[str, list[list[Step]]]]) -> None:
    """Whether each library's runs of one model and beta, all with one seed, trained bitwise
    the same weights at every step; where not, the first run and step that differ."""
    print("\nrepeats: each library's runs (one seed) compared by their weights after every step, "
          "bitwise")
    for setting, by_library in all_runs.items():
        for library, runs in by_library.items():
            drift = first_drift(runs)
            verdict = ("alike at every step" if drift is None
                       else f"run {drift[0] + 1}'s weights differ from run 1's after step "
                            f"{drift[1] + 1}")
            print(f"{setting:16s} {'TRL' if library == 'trl' else library:9s} {len(runs)} run(s): "
                  f"{verdict}")


def kept_run(library: str, folder: Path, model: str, beta: float, pair: int,
             args: argparse.Namespace) -> tuple[list[Step], int]:
    """A run that did not overlap other load, after waiting for a quiet machine before each
    attempt; its steps, and how many attempts were discarded before it."""
    for attempt in range(args.retries + 1):
        wait_for_quiet(args.max_other_load)
        log = folder / "runs" / f"{library}-{model}-beta{beta}-{pair}-{attempt}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        steps, other = run_worker(library, folder, model, beta, args.steps, args.threads, log,
                                  args.selfcest_set)
        if other <= args.max_other_load:
            return steps, attempt
        print(f"discarded {log.stem}: other processes used {other:.2f} cores meanwhile", flush=True)
    raise SystemExit(f"every attempt overlapped other load above {args.max_other_load} cores: "
                     "run on a quiet machine, or raise --max-other-load")


def benchmark(args: argparse.Namespace) -> None:
    """Build the workload, run both libraries alternately for every model and beta, print
    the tables and write every run's steps to ``<workdir>/results.json``."""
    folder = Path(args.workdir)
    build_workload(folder, args.model, args.steps)
    all_runs, results, discarded = {}, {}, 0
    for model in args.model:
        for beta in args.beta:
            runs = {"selfcest": [], "trl": []}
            for pair in range(args.pairs):
                for library in ("selfcest", "trl"):  # alternating: A B A B
                    steps, attempts = kept_run(library, folder, model, beta, pair, args)
                    runs[library].append(steps)
                    discarded += attempts
            all_runs[f"{model} beta={beta}"] = runs
            results[(model, beta)] = {library: summary(r) for library, r in runs.items()}
    (folder / "results.json").write_text(json.dumps(all_runs, indent=1))
    kept = 2 * args.pairs * len(results)
    print(f"{kept} runs kept, {discarded} discarded for overlapping other load "
          f"(> {args.max_other_load} cores); {args.steps} steps a run, {args.threads} thread(s)")
    print_tables(results)
    print_repeats(all_runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["small", "large"], choices=sorted(MODELS))
    parser.add_argument("--beta", nargs="+", type=float, default=[0.0, 0.04])
    parser.add_argument("--steps", type=int, default=8, help="steps a run (the first is warm-up)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="runs of each library per model and beta")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    parser.add_argument("--max-other-load", type=float, default=0.1,
                        help="cores other processes may use during a run before it is discarded")
    parser.add_argument("--retries", type=int, default=3, help="re-runs of a discarded run")
    parser.add_argument("--workdir", default="/tmp/selfcest-vs-trl")
    parser.add_argument("--selfcest-set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="Hydra overrides added to selfcest's runs")
    parser.add_argument("--worker", choices=["selfcest", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        benchmark(args)


def worker(args: argparse.Namespace) -> None:
    """One run, in the process `run_worker` started: its steps to ``--out`` as JSON, its
    trainer's files beside it."""
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.worker == "selfcest":
        steps = run_selfcest(Path(args.folder), args.model[0], args.beta[0], args.steps,
                             out.with_suffix(""),
                             args.selfcest_set)
    else:
        steps = run_trl(Path(args.folder), args.model[0], args.beta[0], args.steps,
                        out.with_suffix(""))
    out.write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
