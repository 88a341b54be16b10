"""A stand-in for the few vLLM entry points VLLMBackend calls, recording every call, so the
backend's own logic (engine arguments, streaming, sleep and wake order, lockstep) runs where
vLLM is not installed. Requests finish after ``steps_per_request`` steps with token 7."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[dict]
    finish_reason: str = "length"


@dataclass
class Output:
    request_id: str
    outputs: list[Sample]
    finished: bool = True


@dataclass
class ModelConfig:
    max_model_len: int = 512
    dtype: torch.dtype = torch.bfloat16

    def get_vocab_size(self) -> int:
        return 100


class Logprob:
    def __init__(self, value: float) -> None:
        self.logprob = value


class Tokenizer:
    def __len__(self) -> int:
        return 100


@dataclass
class Engine:
    """Records ``calls``; ``loaded`` holds (name, dtype) of every tensor a reload consumed."""

    steps_per_request: int = 2
    calls: list = field(default_factory=list)
    loaded: list = field(default_factory=list)
    sleeping: bool = False
    model_config: ModelConfig = field(default_factory=ModelConfig)
    live: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.engine_core = types.SimpleNamespace(shutdown=lambda: self.calls.append("shutdown"))

    def get_tokenizer(self):
        return Tokenizer()

    def add_request(self, request_id, prompt, params) -> None:
        self.calls.append(("add", request_id, tuple(prompt["prompt_token_ids"])))
        self.live[request_id] = self.steps_per_request

    def abort_request(self, ids) -> None:
        self.calls.append(("abort", *ids))
        for request_id in ids:
            self.live.pop(request_id, None)

    def step(self) -> list[Output]:
        self.calls.append("step")
        done = []
        for request_id in list(self.live):
            self.live[request_id] -= 1
            if not self.live[request_id]:
                del self.live[request_id]
                done.append(Output(request_id, [Sample([7], [{7: Logprob(-0.5)}])]))
        return done

    def is_sleeping(self) -> bool:
        return self.sleeping

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        self.sleeping = True

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags or ())))
        self.sleeping = False

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(("collective_rpc", method, tuple(sorted(kwargs or {}))))
        for name, tensor in (kwargs or {}).get("weights_iterator") or ():
            self.loaded.append((name, tensor.dtype))

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True


def install(monkeypatch, engine: Engine) -> dict:
    """Make ``import vllm`` find the stand-in, whose LLMEngine is ``engine``; returns where the
    EngineArgs keyword arguments and the environment at build time are recorded."""
    built: dict = {}

    class EngineArgs:
        def __init__(self, **kwargs) -> None:
            built["args"] = kwargs

        def create_engine_config(self):
            return types.SimpleNamespace()

    def llm_engine(**kwargs):
        import os

        built["environment"] = {key: os.environ.get(key) for key in
                                ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                 "VLLM_ENABLE_V1_MULTIPROCESSING")}
        return engine

    vllm = types.ModuleType("vllm")
    vllm.EngineArgs = EngineArgs
    vllm.LLMEngine = llm_engine
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    executor = types.ModuleType("vllm.v1.executor")
    executor.Executor = types.SimpleNamespace(get_class=lambda config: object)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.v1", types.ModuleType("vllm.v1"))
    monkeypatch.setitem(sys.modules, "vllm.v1.executor", executor)
    return built
