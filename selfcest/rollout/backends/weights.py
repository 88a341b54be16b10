"""A trainer's weights as the plain checkpoint a serving engine loads, one tensor at a time.

`checkpoint_entries` plans every tensor of the checkpoint without reading any: its name
(peft's wrappers taken out), its whole shape, the tensor it is read from, and how to read
it. `check_layout` compares a plan with what the engine serves before anything is loaded;
`stream` reads the tensors in plan order, each made whole (``full_tensor()`` of an FSDP2
shard, a collective that every process runs in the same order), adapters merged and cast to
the engine's dtype, so that at most one whole tensor beyond the model exists at a time (as
TRL streams FSDP2 parameters into vLLM).

peft's layers are merged into the weights they wrap, and the model is left as it is: a LoRA
layer adds its delta to its base weight; trainable tokens (`selfcest.policy.apply_lora` trains
the protocol tokens' embedding rows this way) put their rows into the embedding, and into a
tied LM head, which the checkpoint names as its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.trainable_tokens import TrainableTokensLayer
from safetensors import safe_open
from safetensors.torch import load_file, save_file


class WeightSyncError(RuntimeError):
    """The engine does not (or may not) serve the weights it was asked to load."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint, not read yet."""

    name: str  # its checkpoint name
    shape: tuple[int, ...]  # whole, even where the model holds a shard
    source: int  # id of the tensor it is read from: tied names share one
    read: Callable[[], torch.Tensor]  # the whole tensor, adapters merged


def checkpoint_entries(model) -> list[Entry]:
    """Every tensor of ``model``'s plain checkpoint, in ``state_dict`` order (tied weights under
    every name: vLLM's LM head keeps its old weights unless ``lm_head.weight`` comes too)."""
    is_peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if is_peft else model
    modules = dict(base.named_modules()) if is_peft else {}
    entries = []
    for name, tensor in base.state_dict(keep_vars=True).items():
        if is_peft and _is_adapter_tensor(name):
            continue
        owner, _, _ = name.rpartition(".")
        read = _reader(tensor, modules.get(owner.removesuffix(".base_layer")))
        checkpoint_name = name.replace(".token_adapter.", ".").replace(".base_layer.", ".")
        entries.append(Entry(checkpoint_name, tuple(tensor.shape), id(tensor), read))
    return entries


def _is_adapter_tensor(name: str) -> bool:
    return ".lora_" in name or ".trainable_tokens_" in name


def _reader(tensor: torch.Tensor, layer) -> Callable[[], torch.Tensor]:
    """How to read one state-dict tensor whole, with the peft layer that wraps it merged in."""
    if isinstance(layer, TrainableTokensLayer) and not layer.merged:
        return lambda: _whole(layer.get_merged_weights(layer.active_adapters))
    if isinstance(layer,
                  LoraLayer) and not layer.merged and tensor is layer.get_base_layer().weight:
        return lambda: _whole(tensor) + _lora_delta(layer).to(tensor.dtype)
    return lambda: _whole(tensor)


def _lora_delta(layer: LoraLayer) -> torch.Tensor:
    deltas = [_whole(layer.get_delta_weight(adapter)) for adapter in layer.active_adapters
              if adapter in layer.lora_A or adapter in layer.lora_embedding_A]
    return sum(deltas[1:], deltas[0]) if deltas else torch.zeros(())


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` unsharded (an FSDP2 DTensor is gathered: a collective), without grad."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def weights_stamp(model) -> tuple:
    """Changes whenever ``model``'s weights may have: which tensors, and how often each was
    written in place (torch counts every in-place write of a tensor: optimizer steps, loads)."""
    return tuple((id(p), p._version) for p in model.parameters())


def layout_of(entries: list[Entry]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a plan, tied aliases left out (what a checkpoint file holds)."""
    seen: set[int] = set()
    layout = {}
    for entry in entries:
        if entry.source not in seen:
            seen.add(entry.source)
            layout[entry.name] = entry.shape
    return layout


def folder_layout(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a model folder's safetensors files (from their headers)."""
    layout = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as checkpoint:
            for name in checkpoint.keys():
                layout[name] = tuple(checkpoint.get_slice(name).get_shape())
    if not layout:
        raise FileNotFoundError(f"no safetensors weights in {folder}: save the model with "
                                "save_pretrained")
    return layout


def check_layout(entries: list[Entry], layout: dict[str, tuple[int, ...]]) -> None:
    """Raise `WeightSyncError` unless the plan has every served tensor, shaped alike.

    A name the served checkpoint lacks passes only as an alias of one it has (tied weights,
    which a checkpoint stores once).
    """
    planned = {entry.name: entry for entry in entries}
    problems = [f"{name} missing" for name in layout if name not in planned]
    problems += [
        f"{name} has shape {planned[name].shape}, the engine's {shape}"
        for name, shape in layout.items()
        if name in planned and planned[name].shape != shape
    ]
    served = {planned[name].source for name in layout if name in planned}
    problems += [f"{entry.name} is not in the engine's checkpoint"
                 for entry in entries if entry.name not in layout and entry.source not in served]
    if problems:
        shown = ("; ".join(problems[:5])
                 + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
        raise WeightSyncError(f"these weights do not fit the served model ({shown}); nothing was "
                              "loaded")


def stream(entries: list[Entry], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` in plan order, each read when asked for and cast to ``dtype``; a tied
    tensor is read once and handed out under each of its names."""
    remaining = Counter(entry.source for entry in entries)
    kept: dict[int, torch.Tensor] = {}
    for entry in entries:
        tensor = kept.pop(entry.source, None)
        if tensor is None:
            tensor = entry.read().to(dtype)
        remaining[entry.source] -= 1
        if remaining[entry.source]:
            kept[entry.source] = tensor
        yield entry.name, tensor


def save_checkpoint_file(weights: Iterator[tuple[str, torch.Tensor]], folder: Path) -> None:
    """Write ``weights`` as the folder's only checkpoint file, atomically: a reader never sees
    half a file, and a failed write leaves the old one."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    # Copies, because safetensors refuses tensors that share memory (tied weights).
    save_file({name: tensor.to("cpu", copy=True).contiguous() for name, tensor in weights},
              str(tmp))
    tmp.replace(folder / "model.safetensors")


def read_checkpoint_file(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `save_checkpoint_file` wrote, back from disk."""
    yield from load_file(str(folder / "model.safetensors")).items()
