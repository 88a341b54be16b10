"""Sharded training (FSDP2, through accelerate): what the trainer does differently.

Under FSDP every process holds a shard of each parameter, and every forward and backward of
the training model is a collective: all processes must run the same number of them, in the
same order. Rollouts cannot work that way: each process expands its own trees, for as many
decoding steps as they take. So, when training is sharded:

- rollouts, proximal logprobs and LoRA's reference logprobs use the *rollout model*, a
  full-weight copy of the policy on every process (a colocated vLLM engine holds one
  anyway), refreshed from the shards after every update (`full_weights`);
- every optimizer step runs the same number of micro-batches on every process; a process
  with fewer takes part with empty ones (`selfcest.train.trainer`).

Simplifications, stated: the warm start and the KL reference (without LoRA) train and keep
full copies on every process; LoRA is sharded only when the protocol added no token
(`check_model`); DeepSpeed ZeRO-3 is not supported (its parameters are not DTensors, so
neither `full_weights` nor the checkpoint functions apply).
"""

from __future__ import annotations

import torch
from accelerate import Accelerator, DistributedType
from peft.tuners.trainable_tokens import TrainableTokensLayer
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from selfcest.configure import ConfigError


def check_supported(accelerator: Accelerator) -> None:
    """Raise `ConfigError` for an accelerate setup the trainer cannot run, before any compute."""
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ConfigError(
            "accelerate distributed_type=DEEPSPEED: DeepSpeed ZeRO is not supported; shard the "
            "training with FSDP2 instead (accelerate launch --config_file configs/accelerate/fsdp.yaml)"
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


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a sharded ``model``, whole, on every process.

    A collective: every process must call it. Names are the unsharded model's own
    (FSDP2 keeps them), so the result loads into a plain copy of the model with
    ``load_state_dict``.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

