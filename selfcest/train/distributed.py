"""Cross-process helpers of the trainer: the accelerator, gathers and reductions.

Every helper is one collective call (or none in a single process), so every process must
call it at the same point of its code.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, gather_object, set_seed

from selfcest.algo.losses import aggregation_weights
from selfcest.train.sharding import check_supported

# accelerate's mixed precision of each model.dtype, and the dtype it computes in.
MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def start_accelerator(seed: int, dtype: str = "float32",
                      collective_timeout_s: float = 3600.0) -> Accelerator:
    """The run's accelerator, with global RNGs seeded from ``seed`` (plus the process index).

    ``cpu=True`` on machines without CUDA: without it, two CPU processes each think they are
    alone and never synchronise gradients. ``dtype`` (``model.dtype``) sets the mixed
    precision, whatever ``accelerate launch`` was told: a 16-bit dtype computes under
    autocast while parameters, gradients and optimizer state stay float32. Collectives wait
    ``collective_timeout_s`` before failing. Seeding here means a run's result (dropout, any
    library sampling) does not depend on what the process did before it; a resume restores
    the checkpoint's RNG states on top. Unsupported distributed setups are refused here,
    before any compute (`check_supported`).
    """
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=MIXED_PRECISION[dtype],
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s))],
    )
    check_supported(accelerator)
    set_seed(seed, device_specific=True)
    return accelerator


def gather(accelerator: Accelerator, value: Any) -> list:
    """``value`` of every process, in rank order."""
    if accelerator.num_processes == 1:
        return [value]
    return gather_object([value])


T = TypeVar("T")


def decided_by_main(accelerator: Accelerator, decide: Callable[[], T]) -> T:
    """``decide()`` run on the main process only, its result handed to every process, or its
    error raised on every one (a decision on shared files, taken once: the run's lock, the
    checkpoint to resume)."""
    result, problem = None, None
    if accelerator.is_main_process:
        try:
            result = decide()
        except Exception as error:  # raised below, on every process
            problem = error
    if accelerator.num_processes > 1:
        failure = None if problem is None else (type(problem), str(problem))
        result, failure = gather(accelerator, (result, failure))[0]
        if problem is None and failure is not None:
            problem = failure[0](failure[1])
    if problem is not None:
        raise problem
    return result


def sum_over_processes(accelerator: Accelerator, values: dict[str, float]) -> dict[str, float]:
    parts = gather(accelerator, values)
    return {k: float(sum(p.get(k, 0.0) for p in parts)) for k in values}


def mean_over_processes(accelerator: Accelerator, values: dict[str, float]) -> dict[str, float]:
    """Per key, the mean over the processes that report it."""
    parts = gather(accelerator, values)
    keys = sorted({k for p in parts for k in p})
    return {k: statistics.fmean(p[k] for p in parts if k in p) for k in keys}


def global_weights(accelerator: Accelerator, counts: list[int], tree_ids: list[int],
                   mode: str) -> tuple[list[float], int]:
    """Aggregation weights (`aggregation_weights`) over one optimizer step's samples of every
    process, and the step's total trainable tokens. This process's share of the weights is
    returned, scaled by the world size because DDP averages gradients over processes."""
    everyone = gather(accelerator, (counts, tree_ids))
    all_counts = [c for part, _ in everyone for c in part]
    all_ids = [t for _, part in everyone for t in part]
    weights = aggregation_weights(all_counts, all_ids, mode)
    offset = sum(len(part) for part, _ in everyone[: accelerator.process_index])
    mine = [w * accelerator.num_processes for w in weights[offset : offset + len(counts)]]
    return mine, sum(all_counts)
