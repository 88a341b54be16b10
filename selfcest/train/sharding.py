"""Sharded training (FSDP2, through accelerate): what the trainer does differently.

Under FSDP every process holds a shard of each parameter, and every forward and backward of the
training model is a collective: all processes must run the same number of them, in the same
order. Rollouts cannot work that way: each process expands its own trees, for as many decoding
steps as they take. So, when training is sharded, hf rollouts use a full-weight copy of the
policy on every process (`refresh_copy`), vLLM streams the weights into its engine, every
process runs the same number of micro-batches per step, and the KL reference is sharded like the
model (`shard_frozen`). `check_supported` spells out each of these and what is not supported.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator, DistributedType
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from peft.tuners.trainable_tokens import TrainableTokensLayer

from selfcest.configure import ConfigError


def check_supported(accelerator: Accelerator) -> None:
    """Raise `ConfigError` for an accelerate setup the trainer cannot run, before any compute.

    When training is sharded:

    - with the hf backend, which decodes with a model of its own process, rollouts, proximal
      logprobs and LoRA's reference logprobs use the *rollout model*, a full-weight copy of the
      policy on every process, refreshed from the shards tensor by tensor after every update
      (`refresh_copy`);
    - with vLLM, which holds its own copy, there is no rollout model: the weights are streamed
      into the engine one whole tensor at a time (`selfcest.rollout.backends.weights`), and the
      proximal and LoRA-reference passes run through the sharded model;
    - every optimizer step runs the same number of micro-batches on every process; a process
      with fewer takes part with empty ones (`selfcest.train.trainer`), and so do the proximal
      and reference passes where they run through sharded models;
    - the KL reference (without LoRA) is sharded like the model (`shard_frozen`).

    Simplifications, stated: the warm start trains a full copy on every process; LoRA is sharded
    only when the protocol added no token (`check_model`); DeepSpeed ZeRO-3 is not supported (its
    parameters are not DTensors, so neither the streaming nor the checkpoint functions apply).
    """
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ConfigError(
            "accelerate distributed_type=DEEPSPEED: DeepSpeed ZeRO is not supported; shard the "
            "training with FSDP2 instead (accelerate launch --config_file "
            "configs/accelerate/fsdp.yaml)"
        )
    if kind != DistributedType.FSDP:
        return
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise ConfigError(
            f"accelerate fsdp_config.fsdp_version={plugin.fsdp_version}: the trainer supports "
            "FSDP2 only; set fsdp_version: 2 (as configs/accelerate/fsdp.yaml does)"
        )
    if plugin.cpu_ram_efficient_loading:
        raise ConfigError(
            "accelerate fsdp_config.fsdp_cpu_ram_efficient_loading=true: the trainer keeps a "
            "full-weight rollout copy built on every process before sharding, which that "
            "option leaves empty on all but the first; set it to false"
        )


def check_model(model) -> None:
    """Raise `ConfigError` for a model FSDP2 cannot shard, before any compute.

    LoRA that also trains the protocol tokens' embedding rows (peft's trainable tokens, which
    `selfcest.policy.apply_lora` adds when the protocol brought new tokens) wraps the tied
    embedding twice, and accelerate's FSDP2 preparation then shards that weight twice.
    """
    if any(isinstance(module, TrainableTokensLayer) for module in model.modules()):
        raise ConfigError(
            "model.lora with new protocol tokens (their embedding rows train through peft's "
            "trainable tokens) cannot be sharded by FSDP2: train it data parallel "
            "(configs/accelerate/ddp.yaml; adapters keep the optimizer state small), or shard "
            "a full fine-tune (model.lora=null)"
        )


def is_sharded(accelerator: Accelerator) -> bool:
    """Whether the training model's parameters are sharded over the processes."""
    return accelerator.distributed_type == DistributedType.FSDP


@torch.no_grad()
def refresh_copy(copy: torch.nn.Module, sharded: torch.nn.Module) -> None:
    """Load a sharded model's weights into a plain ``copy`` of it, one whole tensor at a time
    (no second full state dict). A collective: every process must call it."""
    target = copy.state_dict()
    for name, tensor in sharded.state_dict().items():
        target[name].copy_(tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor)


def shard_frozen(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen model (the KL reference) sharded as accelerate shards the trained one."""
    return fsdp2_prepare_model(accelerator, model)
