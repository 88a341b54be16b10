"""GPU smoke check: a realistic-size random model trains a few GRPO steps; prints a table.

No network and no downloaded weights: the model is a Qwen2 built from a config (the shape
of Qwen2.5-0.5B: hidden 896, 24 layers, vocab 151,936) with random weights, which is valid
for throughput, memory and MFU figures. Rollouts use the HF backend; the vLLM backend is
measured too where vllm imports. On a CPU it runs a much smaller shape (``--shape cpu``).

    python scripts/gpu_smoke.py                 # on one NVIDIA GPU, a few minutes
    python scripts/gpu_smoke.py --shape cpu     # the same code path, small, on a CPU

MFU is ``6 x parameters x training tokens/s`` (the usual dense-transformer estimate,
attention FLOPs ignored) over the bf16 matmul rate measured on this device in this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from selfcest.budget import Budget
from selfcest.policy import ClonePolicy, build_tokenizer
from selfcest.protocol import TokenProtocol
from selfcest.rewards.base import RewardResult
from selfcest.train.config import TrainConfig
from selfcest.train.trainer import GRPOTrainer

SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "0.5b": (896, 24, 14, 2, 4864, 151936),
    "cpu": (128, 4, 4, 2, 384, 4096),
}


def matmul_rate(device: str, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Measured FLOP/s of a square matmul on this device."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def even_token_reward(tree, task) -> RewardResult:
    """Share of even token ids among the generated ones: a synthetic reward that varies under
    a random policy, so every group has variance and every step trains."""
    ids = [t for node in tree.nodes.values() for s in node.segments if s.trainable for t in s.token_ids]
    return RewardResult(score=sum(t % 2 == 0 for t in ids) / max(1, len(ids)), correct=False)


def build_policy(shape: str, device: str, dtype: torch.dtype) -> ClonePolicy:
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
    return ClonePolicy(model, tokenizer, TokenProtocol(tokenizer))


def run(args) -> list[tuple[str, str]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = [("device", torch.cuda.get_device_name() if device == "cuda" else "cpu")]
    peak = matmul_rate(device, torch.bfloat16 if device == "cuda" else torch.float32,
                       8192 if device == "cuda" else 1024)
    rows.append(("measured matmul rate", f"{peak / 1e12:.1f} TFLOP/s ({dtype})"))
    policy = build_policy(args.shape, device, dtype)
    params = sum(p.numel() for p in policy.model.parameters())
    rows.append(("model", f"Qwen2 shape '{args.shape}', {params / 1e6:.0f}M parameters, random weights"))

    config = TrainConfig()
    config.task.params = {"split": "train", "n_train": 512, "n_test": 8, "n_ood": 8}
    config.rollout.budget = Budget(node_generation=args.gen, tree_generation=4 * args.gen, node_context=1024)
    config.rollout.max_batch_size = 256
    config.trainer.prompts_per_step = args.prompts
    config.trainer.trees_per_prompt = 4
    config.trainer.tokens_per_micro_batch = args.micro_tokens
    config.trainer.output_dir = "/tmp/selfcest-gpu-smoke"
    config.trainer.lr = 1e-6
    config.log.progress = False
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(config, policy=policy, reward_fn=even_token_reward)
    history = [trainer.step() for _ in range(args.steps)]
    measured = history[1:] or history  # the first step warms up kernels and allocators
    mean = lambda key: statistics.fmean(h[key] for h in measured)  # noqa: E731
    train_rate = mean("throughput/train_tokens_per_s")
    rows += [
        ("rollout tokens/s (HF backend)", f"{mean('throughput/rollout_tokens_per_s'):,.0f}"),
        ("training tokens/s", f"{train_rate:,.0f}"),
        ("training MFU", f"{6 * params * train_rate / peak:.1%}"),
        ("padding fraction", f"{mean('train/padding_frac'):.1%}"),
        ("step time split (rollout/train/sync)",
         f"{mean('time/rollout'):.2f}s / {mean('time/training'):.2f}s / {mean('time/sync') * 1e3:.1f}ms"),
        ("weight sync (HF backend, shared weights)", f"{mean('time/sync') * 1e3:.1f} ms"),
    ]
    if device == "cuda":
        rows.append(("peak GPU memory", f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"))
    trainer.close()
    rows.append(vllm_row(policy))
    return rows


def vllm_row(policy: ClonePolicy) -> tuple[str, str]:
    """Weight-sync time of the vLLM backend, where vllm imports."""
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM backend", "skipped: vllm does not import here")
    from selfcest.rollout.backends.vllm import VLLMBackend

    backend = VLLMBackend.from_policy(policy)
    start = time.perf_counter()
    backend.sync_weights(policy.model)
    elapsed = time.perf_counter() - start
    backend.close()
    return ("weight sync (vLLM backend)", f"{elapsed:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32 if torch.cuda.is_available() else 4)
    parser.add_argument("--gen", type=int, default=128 if torch.cuda.is_available() else 16)
    parser.add_argument("--micro-tokens", type=int, default=32768 if torch.cuda.is_available() else 4096)
    args = parser.parse_args()
    rows = run(args)
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


if __name__ == "__main__":
    main()
