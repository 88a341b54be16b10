"""The one thread that drives an in-process vLLM engine, and the lockstep of a tensor-parallel
group.

vLLM's engine is not thread-safe; funnelling every use through one thread also keeps
per-thread state (CPU thread binding, CUDA device and streams) where the engine was set up.
Requests go in with ``add_request`` and every ``step`` advances all running requests
together, so a branch that arrives while others decode joins the next step.

With vLLM's external launcher every process of a tensor-parallel group runs an engine of its
own over its shard, and their steps all-reduce with each other: the engines must take the
same requests before the same steps, or their collectives no longer match (vLLM's
``ExecutorWithExternalLauncher`` assumes identical inputs; TRL feeds every rank of the group
the same prompts for that reason). A tree rollout decides its requests as it goes, so one
process (the group's leader) drives and `Lockstep` replays on the others exactly what the
leader's engine did between two steps: the requests added, those aborted, whether it steps.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from selfcest.rollout.backends.base import Completion

_END = "end"  # what the leader broadcasts when it stops driving


@dataclass
class Request:
    """One generation request on its way to the engine thread."""

    prompt_ids: list[int]
    params: Any  # vllm.SamplingParams
    weight_version: int
    deliver: Callable[[Completion | BaseException], None]  # called on the engine thread
    id: str = ""  # given by the engine thread unless set
    cancelled: bool = False  # its awaiter gave up before it reached the engine


class Lockstep:
    """Replays a leader engine's operations on the other engines of its tensor-parallel group.

    ``group`` is a gloo group of the group's processes (the broadcasts carry small Python
    objects); ``leader`` its first rank, in the default group's numbering."""

    def __init__(self, group, leader: int) -> None:
        self.group, self.leader = group, leader

    def publish(self, operations: list[tuple], step: bool) -> None:
        """Leader: what its engine did since the last step, and whether it steps now."""
        self._send((operations, step))

    def end(self) -> None:
        """Leader: it stops driving; the followers' `follow` returns."""
        self._send(_END)

    def follow(self, engine) -> None:
        """Follower: apply the leader's operations and steps until it stops driving."""
        while (received := self._receive()) != _END:
            operations, step = received
            for operation in operations:
                _apply(engine, operation)
            if step:
                engine.step()

    def _send(self, payload) -> None:
        dist.broadcast_object_list([payload], src=self.leader, group=self.group)

    def _receive(self):
        received: list = [None]
        dist.broadcast_object_list(received, src=self.leader, group=self.group)
        return received[0]


def token_prompt(prompt_ids: list[int]) -> dict:
    """A prompt of token ids as vLLM's engine takes it (its ``TokensInput``; a raw
    ``{"prompt_token_ids": ...}`` is deprecated there and goes through its renderer)."""
    return {"type": "token", "prompt_token_ids": prompt_ids}


def _apply(engine, operation: tuple) -> None:
    kind = operation[0]
    if kind == "add":
        try:
            engine.add_request(operation[1], token_prompt(operation[2]), operation[3])
        except Exception:  # the leader's engine refused it too and failed that request alone
            pass
    elif kind == "abort":
        engine.abort_request([operation[1]])


class EngineThread:
    """The engine's thread: builds it, steps it, runs calls on it.

    Other threads talk to it through messages: ``("generate", requests)``, ``("abort",
    request)``, ``("call", fn, future)``, ``("lead", lockstep | None)`` (start or stop
    publishing every step to the group's followers) and ``("stop",)``.
    """

    def __init__(self, build: Callable[[], Any], spare_group: bool) -> None:
        """``spare_group``: leave torch.distributed's default group alone at shutdown (it is the
        trainer's, not the engine's)."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Request] = {}
        self._ids = itertools.count()
        self._lockstep: Lockstep | None = None
        self._spare_group = spare_group
        self._error: BaseException | None = None  # why the thread stopped
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, ready), name="selfcest-vllm",
                                        daemon=True)
        self._thread.start()
        self.engine = ready.result()  # engine start-up errors surface here

    # ---------------------------------------------------------------- other threads

    def check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the vLLM engine has stopped: {self._error}")

    def submit(self, requests: list[Request]) -> None:
        self._post(("generate", requests))

    def abort(self, request: Request) -> None:
        self._post(("abort", request))

    def lead(self, lockstep: Lockstep | None) -> None:
        self._post(("lead", lockstep))

    def call(self, fn: Callable[[Any], Any], timeout: float | None) -> Any:
        """Run ``fn(engine)`` between engine steps; raise if it fails or outlasts ``timeout``."""
        self.check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, done))
        try:
            return done.result(timeout=None if timeout is None else max(0.0, timeout))
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
                operations: list[tuple] = []
                for message in messages:
                    if message[0] == "stop":
                        raise _Stopped("the vLLM backend was closed")
                    self._handle(engine, message, operations)
                if self._lockstep is not None and (operations or self._live):
                    self._lockstep.publish(operations, bool(self._live))
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
            shutdown(engine, self._spare_group)

    def _handle(self, engine, message: tuple, operations: list[tuple]) -> None:
        kind = message[0]
        if kind == "generate":
            if engine.is_sleeping():  # put to sleep (level 1) for a training phase: wake fully
                empty_cache()
                engine.wake_up()
            for request in message[1]:
                if not request.cancelled:
                    self._add(engine, request, operations)
        elif kind == "abort":
            request = message[1]
            if self._live.pop(request.id, None) is not None:
                engine.abort_request([request.id])
                operations.append(("abort", request.id))
        elif kind == "lead":
            if self._lockstep is not None and message[1] is None:
                self._lockstep.end()
            self._lockstep = message[1]
        elif kind == "call":
            fn, done = message[1], message[2]
            if self._live:
                done.set_exception(RuntimeError(f"{len(self._live)} generation requests are still "
                                                "running"))
                return
            try:
                done.set_result(fn(engine))
            except BaseException as error:
                done.set_exception(error)

    def _add(self, engine, request: Request, operations: list[tuple]) -> None:
        request.id = request.id or str(next(self._ids))
        operations.append(("add", request.id, request.prompt_ids, request.params))
        try:
            engine.add_request(request.id, token_prompt(request.prompt_ids), request.params)
        except Exception as error:  # a request vLLM rejects fails alone
            request.deliver(error)
            return
        self._live[request.id] = request

    def _finish(self, output) -> None:
        request = self._live.pop(output.request_id, None)
        if request is None:  # aborted meanwhile
            return
        try:
            completion = completion_of(output, request.weight_version)
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


def completion_of(output, weight_version: int) -> Completion:
    sample = output.outputs[0]
    if sample.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended the request with finish_reason={sample.finish_reason!r}")
    tokens = list(sample.token_ids)
    logprobs = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
    return Completion(tokens, logprobs, sample.finish_reason, weight_version)


def empty_cache() -> None:
    """Hand the memory PyTorch's allocator holds but does not use back to the GPU.

    After an update the allocator keeps the freed activations and logits (10-20 GB for a
    32k-token micro-batch over a 152k vocabulary) cached; vLLM maps its weights and KV cache
    outside that allocator, so without this a wake-up finds the GPU full (TRL and verl empty
    the cache before every wake-up for this reason)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shutdown(engine, spare_group: bool) -> None:
    """Shut the in-process engine core down; with ``spare_group``, keep torch.distributed's
    default group: vLLM's shutdown ends with ``destroy_process_group()``, which in a trainer's
    process destroys the trainer's group, and every later collective would fail."""
    if not spare_group:
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
