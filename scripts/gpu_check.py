"""The one-shot GPU check: what a lent GPU machine should tell us, in one run, as one JSON.

It runs on a bare machine: torch, transformers, accelerate and peft, nothing else of
selfcest's requirements (no vLLM, no Hydra: nothing on this import path needs them), no
network, no weights (random Qwen2 models built from a config, which is valid for
throughput, memory, MFU and agreement figures). ``--cpu`` runs the same code on tiny shapes
(CI runs it, so a GPU run cannot fail on what a CPU would catch). Measured:

- training: the GRPO step of a 0.5B- and a 1.5B-shape Qwen2 in bfloat16 (float32 master
  weights), FSDP2 over one process, activation checkpointing off and on: trained tokens/s,
  MFU (6 x parameters x trained tokens/s over the bf16 matmul rate measured here; the
  recomputation of checkpointing is not counted), step time split, peak GPU memory, and
  how far the HF rollout's logprobs of the sampled tokens are from the trainer's;
- rollout: clone trees against flat generation of as many tokens on the HF backend
  (`benchmarks/rollout.py`), on the smaller shape after a short warm start teaches it to
  delegate;
- determinism: two runs of two steps from one seed, bitwise equal or not.

    bash scripts/gpu_check.sh [--out runs/gpu_check.json]   # one NVIDIA GPU, under 8 minutes
    bash scripts/gpu_check.sh --cpu                          # the same code, tiny, ~1 minute
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator, DistributedType, FullyShardedDataParallelPlugin, PartialState
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.rollout import BUDGET as TREE_BUDGET
from benchmarks.rollout import time_flat, time_trees
from selfcest.budget import Budget
from selfcest.policy import ClonePolicy, build_tokenizer
from selfcest.protocol import TokenProtocol
from selfcest.rewards.base import RewardResult
from selfcest.tasks import load_tasks
from selfcest.train import distributed
from selfcest.train.config import TaskSourceConfig, TrainConfig
from selfcest.train.setup import build_trainer
from selfcest.train.sft import SFTConfig, train_sft
from selfcest.train.traces import demonstrations

SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocabulary
    "0.5b": (896, 24, 14, 2, 4864, 151936),
    "1.5b": (1536, 28, 12, 2, 8960, 151936),
    "cpu-s": (64, 2, 4, 2, 192, 4096),
    "cpu-m": (128, 4, 4, 2, 384, 4096),
}


@dataclass(frozen=True)
class Plan:
    """How big every part of the check is on this device."""

    shapes: tuple[str, ...]
    steps: int  # training steps per setting; the first is left out of the means
    prompts: int
    generate: int  # tokens a node may generate
    micro_tokens: int
    sft_steps: int  # warm start of the rollout comparison
    tasks: int  # trees of the rollout comparison
    matmul: int


GPU = Plan(("0.5b", "1.5b"), steps=3, prompts=32, generate=128, micro_tokens=16384, sft_steps=80,
           tasks=64,
           matmul=8192)
CPU = Plan(("cpu-s", "cpu-m"), steps=3, prompts=4, generate=16, micro_tokens=2048, sft_steps=150,
           tasks=8,
           matmul=512)


def sharded_accelerator(**kwargs) -> Accelerator:
    """The trainer's accelerator in the state ``accelerate launch --config_file
    configs/accelerate/fsdp.yaml`` sets (FSDP2), over the one-process group of this check;
    accelerate shards on CPUs only when told, so both devices take the same path."""
    accelerator = Accelerator(**kwargs)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                            auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True,
                                            state_dict_type="FULL_STATE_DICT",
                                            cpu_ram_efficient_loading=False)
    plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def start_process_group(device: torch.device) -> None:
    with socket.socket() as probe:  # a free port for the one-process group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_rate(device: torch.device, size: int, repeats: int = 10) -> float:
    """Measured bf16 FLOP/s of a square matmul on this device."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(2):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def random_policy(shape: str, device: torch.device) -> ClonePolicy:
    """A Qwen2 of ``shape`` with random float32 weights, built on ``device``."""
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden,
                         intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config)
    return ClonePolicy(model, tokenizer, TokenProtocol(tokenizer))


def even_token_reward(tree, task) -> RewardResult:
    """Share of even token ids among the generated ones: varies under a random policy, so
    every group has variance and every step trains."""
    ids = [t for node in tree.nodes.values() for s in node.segments if s.trainable
           for t in s.token_ids]
    return RewardResult(score=sum(t % 2 == 0 for t in ids) / max(1, len(ids)), correct=False)


def train_config(plan: Plan, out: Path, checkpointing: bool, steps: int) -> TrainConfig:
    config = TrainConfig()
    config.model.dtype = "bfloat16"
    config.model.gradient_checkpointing = checkpointing
    config.task.params = {"split": "train", "n_train": 512, "n_test": 8, "n_ood": 8}
    config.rollout.budget = Budget(node_generation=plan.generate, tree_generation=4 * plan.generate,
                                   node_context=1024)
    config.rollout.max_batch_size = 256
    config.trainer.steps = steps
    config.trainer.prompts_per_step = plan.prompts
    config.trainer.tokens_per_micro_batch = plan.micro_tokens
    config.trainer.lr = 1e-6
    config.trainer.output_dir = str(out)
    config.trainer.save_final = False
    config.log.progress = False
    return config


def train_run(plan: Plan, shape: str, checkpointing: bool, device: torch.device, peak: float,
              out: Path) -> dict:
    """``plan.steps`` GRPO steps of ``shape``; the means leave the first step out (kernels
    and allocators warming up)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    policy = random_policy(shape, device)
    params = sum(p.numel() for p in policy.model.parameters())
    trainer = build_trainer(train_config(plan, out, checkpointing, plan.steps), policy=policy,
                            reward_fn=even_token_reward)
    history = trainer.train()
    trainer.close()
    measured = history[1:] or history
    mean = lambda key: statistics.fmean(h.get(key, 0.0) for h in measured)  # noqa: E731
    tokens_per_s = mean("throughput/train_tokens_per_s")
    row = {
        "shape": shape, "checkpointing": checkpointing, "parameters": params,
        "train_tokens_per_s": tokens_per_s, "mfu": 6 * params * tokens_per_s / peak,
        "step_s": mean("time/step"), "rollout_s": mean("time/rollout"),
        "training_s": mean("time/training"),
        "rollout_tokens_per_s": mean("throughput/rollout_tokens_per_s"),
        "trained_tokens": mean("train/trainable_tokens"),
        "padding_frac": mean("train/padding_frac"),
        "logprob_diff_mean": mean("rollout/logprob_diff_mean"), "logprob_diff_max": max(
            h.get("rollout/logprob_diff_max", 0.0) for h in measured),
    }
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer, policy
    return row


def rollout_comparison(plan: Plan, device: torch.device) -> dict:
    """Clone trees against flat generation of as many tokens, on the HF backend, after a short
    warm start on the keyed_sum teacher's demonstrations (so the trees have clones)."""
    policy = random_policy(plan.shapes[0], device)
    source = TaskSourceConfig("keyed_sum",
                              {"split": "train", "n_train": 256, "n_test": 0, "n_ood": 0})
    trees = demonstrations(source, "keyed_sum", {}, policy.protocol, TREE_BUDGET)
    start = time.perf_counter()
    loss = train_sft(policy, trees,
                     SFTConfig(steps=plan.sft_steps, lr=3e-4 if device.type == "cuda" else 3e-3,
                               warmup_steps=5))[-1]["sft/loss"]
    sft_s = time.perf_counter() - start
    tasks = load_tasks("keyed_sum", split="test", n_train=0, n_test=plan.tasks, n_ood=0)
    with torch.autocast(device.type, torch.bfloat16):
        time_trees(policy, tasks[:2], batch_size=256)  # warm-up
        tree_s, trees, _ = time_trees(policy, tasks, batch_size=256)
        generated = sum(t.costs().generated_tokens for t in trees)
        flat_s, _ = time_flat(policy, tasks, max(1, round(generated / len(tasks))))
    return {"shape": plan.shapes[0], "warm_start_steps": plan.sft_steps, "warm_start_loss": loss,
            "warm_start_s": sft_s, "trees": len(trees),
            "clones_per_tree": sum(t.costs().clones for t in trees) / len(trees),
            "generated_tokens": generated, "trees_tokens_per_s": generated / tree_s,
            "flat_tokens_per_s": generated / flat_s, "trees_over_flat_time": tree_s / flat_s}


def weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode() + whole.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def bitwise_repeat(plan: Plan, device: torch.device, out: Path) -> dict:
    """Two runs of two steps of the smaller shape from one seed: the same weights, bit for bit?"""
    digests = []
    for run in range(2):
        trainer = build_trainer(train_config(plan, out / f"repeat{run}", False, 2),
                                policy=random_policy(plan.shapes[0], device),
                                reward_fn=even_token_reward)
        trainer.train()
        digests.append(weights_digest(trainer.model))
        trainer.close()
        del trainer
    return {"shape": plan.shapes[0], "steps": 2, "bitwise_equal": digests[0] == digests[1],
            "digests": digests}


def table(report: dict) -> str:
    lines = [f"device: {report['device']}   bf16 matmul: {report['matmul_tflops']:.1f} TFLOP/s   "
             f"({report['seconds']:.0f} s)",
             f"{'shape':<7}{'ckpt':<6}{'tokens/s':>10}{'MFU':>8}{'step s':>8}{'rollout s':>10}"
             f"{'peak GiB':>10}{'|dlogp| mean/max':>20}"]
    for row in report["train"]:
        memory = f"{row['peak_memory_gib']:.1f}" if "peak_memory_gib" in row else "-"
        lines.append(
            f"{row['shape']:<7}{'on' if row['checkpointing'] else 'off':<6}"
            f"{row['train_tokens_per_s']:>10,.0f}{row['mfu']:>8.1%}{row['step_s']:>8.2f}{row['rollout_s']:>10.2f}{memory:>10}"
            f"{row['logprob_diff_mean']:>11.2e}/{row['logprob_diff_max']:.2e}")
    rollout = report["rollout"]
    lines.append(f"rollout ({rollout['shape']}, HF backend): trees "
                 f"{rollout['trees_tokens_per_s']:,.0f} tokens/s, flat "
                 f"{rollout['flat_tokens_per_s']:,.0f} tokens/s, trees/flat time "
                 f"{rollout['trees_over_flat_time']:.2f}x, {rollout['clones_per_tree']:.1f} clones "
                 "per tree")
    repeat = report["bitwise_repeat"]
    lines.append(f"two runs of {repeat['steps']} steps, one seed: "
                 f"{'bitwise equal' if repeat['bitwise_equal'] else 'DIFFER'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="the same check on tiny shapes, on a machine without CUDA")
    parser.add_argument("--out", default="runs/gpu_check.json",
                        help="the JSON report (a table goes to stdout)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --cpu for the CPU check")
    started = time.perf_counter()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    plan = CPU if args.cpu else GPU
    if args.cpu:
        torch.set_num_threads(1)
    start_process_group(device)
    distributed.Accelerator = sharded_accelerator
    out = Path(args.out)
    work = out.with_suffix("")  # the runs' folders
    peak = matmul_rate(device, plan.matmul)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.processor() or 'cpu'})",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda,
                     "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__},
        "matmul_tflops": peak / 1e12,
        "train": [train_run(plan, shape, checkpointing, device, peak,
                            work / f"{shape}-{checkpointing}")
                  for shape in plan.shapes for checkpointing in (False, True)],
        "rollout": rollout_comparison(plan, device),
        "bitwise_repeat": bitwise_repeat(plan, device, work),
    }
    report["seconds"] = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"report: {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
