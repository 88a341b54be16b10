"""Run by torchrun in test_distributed.py: CPU processes train two steps, data parallel
(``ddp``) or sharded (``fsdp``); each writes what the test compares.

    distributed_worker.py OUT REWARD MODE

MODE: ddp|node|vllm|node_vllm|fsdp|fsdp_vllm|fsdp_lora|fsdp_lora_tokens.

``node`` is data parallel with one engine for the node, on its first process
(rollout.engine_per_node); ``vllm`` data parallel with a vLLM engine in every process (vLLM's
external launcher); ``node_vllm`` one tensor-parallel vLLM engine over the node's two
processes, driven by the first; ``fsdp_vllm`` sharded, with a vLLM engine in every process fed
from the shards. ``fsdp_lora`` passes
a LoRA policy without trainable tokens (what a pretrained model whose vocabulary holds the
protocol's tokens gets); ``fsdp_lora_tokens`` the config's own, which the trainer must
refuse.

accelerate shards only on accelerators (on CPU it falls back to DDP), so for ``fsdp`` the
trainer's accelerator gets the state accelerate's launcher sets from
configs/accelerate/fsdp.yaml on GPUs; everything after that is accelerate's and the
trainer's real FSDP2 path, on gloo.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import (
    Accelerator,
    DistributedType,
    FullyShardedDataParallelPlugin,
    PartialState,
)
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from selfcest.budget import Budget
from selfcest.configure import ConfigError
from selfcest.policy import ClonePolicy, LoraSettings, apply_lora
from selfcest.rollout.backends.vllm import VLLMConfig
from selfcest.train import distributed as distributed_module
from selfcest.train.config import TrainConfig
from selfcest.train.setup import build_trainer

out, reward, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]


def fsdp_accelerator(**kwargs) -> Accelerator:
    accelerator = Accelerator(**kwargs)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False,
    )
    return accelerator


def config(resume: bool = False, lora: bool = "lora" in mode) -> TrainConfig:
    config = TrainConfig()
    config.task.reward = reward
    config.task.params = {"split": "train", "n_train": 32, "n_test": 4, "n_ood": 4}
    config.rollout.budget = Budget(node_generation=16, tree_generation=32, node_context=256)
    config.trainer.steps = 2
    config.trainer.prompts_per_step = 4
    # Small micro-batches, so processes hold different numbers of them in a step.
    config.trainer.tokens_per_micro_batch = 256
    config.trainer.lr = 1e-2
    # The paths that read the rollout copy under FSDP: KL reference and proximal logprobs.
    config.algo.loss.kl_coef = 0.05
    config.algo.recompute_old_logprobs = True
    config.trainer.output_dir = str(out / "run")
    config.trainer.resume = resume
    config.log.progress = False
    config.rollout.engine_per_node = mode.startswith("node")
    if mode == "node":
        config.trainer.save_every = 1  # the test compares the weights after the first step
    if mode.endswith("vllm"):
        config.model.name = "small"  # vLLM's CPU attention needs heads of 32
        config.rollout.backend = "vllm"
        config.rollout.vllm = VLLMConfig(dtype="float32", max_model_len=512, enforce_eager=True,
                                         tensor_parallel_size=2 if mode == "node_vllm" else 1)
    if lora:
        config.model.lora = LoraSettings(r=4, alpha=8)
    return config


def policy() -> ClonePolicy | None:
    if mode != "fsdp_lora":
        return None
    built = ClonePolicy.build_tiny(seed=0)
    built.model = apply_lora(built.model, LoraSettings(r=4, alpha=8))
    return built


def full(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (a sharded one gathered: every process calls)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def record_trees(trainer) -> list[list[list[int]]]:
    """Each step's trees on this process, as every node's token ids, in the order trained."""
    steps = []
    train_on_trees = trainer.train_on_trees

    def recording(trees):
        steps.append([[node.context_ids() for node in tree.nodes.values()] for tree in trees])
        return train_on_trees(trees)

    trainer.train_on_trees = recording
    return steps


def main() -> None:
    torch.set_num_threads(1)
    if mode.startswith("fsdp"):
        distributed_module.Accelerator = fsdp_accelerator
    if mode == "fsdp_lora_tokens":
        try:
            build_trainer(config())
        except ConfigError as error:
            (out / f"refused{int(os.environ['RANK'])}.txt").write_text(str(error))
        return
    trainer = build_trainer(config(), policy=policy())
    trees = record_trees(trainer)
    before = full(trainer.policy.model)
    history = trainer.train()
    rank = trainer.accelerator.process_index
    after = full(trainer.policy.model)  # the rollout weights: whole, refreshed after every update
    shard = next(trainer.model.parameters())
    trainer.close()

    # from the checkpoint the run just saved
    resumed = build_trainer(config(resume=True), policy=policy())
    resumed_step = resumed.state.step
    resumed_equal = all(torch.equal(after[n], p) for n, p in full(resumed.policy.model).items())
    resumed.close()
    mismatch = None
    if mode == "ddp":  # a checkpoint that does not fit the model fails on every rank
        try:
            build_trainer(config(resume=True, lora=True))
        except (ValueError, RuntimeError) as error:
            mismatch = str(error)

    save_file({f"{k}": v.contiguous() for k, v in after.items()}, out / f"rank{rank}.safetensors")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world": trainer.accelerator.num_processes,
        "backend": type(trainer.backend).__name__,
        "follower": getattr(trainer.backend, "is_follower", None),
        "sync": getattr(getattr(trainer.backend, "last_sync", None), "method", None),
        "rollout_copy": trainer.rollout_model is not None,
        "logprob_diff_max": max(m.get("rollout/logprob_diff_max", 0.0) for m in history),
        "stale_refused": sum(m["samples/stale_refused"] for m in history),
        "sharded": isinstance(shard, DTensor) and shard.to_local().numel() < shard.numel(),
        "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "trainable": sorted(n for n,
                            p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
                            if p.requires_grad),
        "resumed_step": resumed_step,
        "resumed_equal": resumed_equal,
        "mismatch": mismatch,
        "trees": trees,
    }))


if __name__ == "__main__":  # vLLM starts its workers by spawning this module
    main()
