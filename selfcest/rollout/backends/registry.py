"""One registry of generation backends, picked by name everywhere: training, evaluation,
experiments and notebooks (``rollout.backend=hf|vllm``, ``ClonePolicy.backend("vllm")``).

A backend is built for a policy (anything with ``model``, ``tokenizer`` and, for vLLM,
``save_pretrained``'s inputs) from `BackendSettings`. `require_backend` refuses a backend
whose package is missing before any compute, with the install step. Engines that are slow to
start (vLLM) are shared: `serve` keeps one per process and loads the weights of whichever
policy asks, when they are not the ones it serves already.
"""

from __future__ import annotations

import atexit
import importlib.util
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from selfcest.configure import Choice, ConfigError, is_number, require, setting
from selfcest.rollout.backends.base import Backend
from selfcest.rollout.backends.hf import HFBackend
from selfcest.rollout.backends.vllm import INSTALL_HINT, VLLMBackend, VLLMConfig
from selfcest.rollout.backends.weights import weights_stamp


class BackendName(Choice):
    hf = "hf"  # transformers, any machine
    vllm = "vllm"  # pip install 'selfcest[vllm]'


@dataclass
class BackendSettings:
    """Which engine generates, and its settings."""

    backend: BackendName = setting(BackendName.hf,
                                   help="generation engine: hf (transformers, any machine) or vllm")
    max_batch_size: int = setting(64,
                                  help="hf backend: most sequences decoded together in one batch")
    prefix_cache_mb: float = setting(512, help=(
        "hf backend: memory (MiB) for the KV cache of nodes that stopped on a spawn call, so "
        "that resuming with the clones' answers prefills only the answers (0 = off)"))
    vllm: VLLMConfig = setting(help="vLLM engine settings, used when backend is vllm",
                               factory=VLLMConfig)

    def check(self) -> None:
        require_backend(self.backend)
        require(is_number(self.max_batch_size) and self.max_batch_size >= 1, "max_batch_size",
                f"must be a number >= 1; got {self.max_batch_size!r}")
        require(is_number(self.prefix_cache_mb) and self.prefix_cache_mb >= 0, "prefix_cache_mb",
                f"must be a number >= 0; got {self.prefix_cache_mb!r}")


@dataclass(frozen=True)
class BackendSpec:
    """How to build one kind of backend."""

    build: Callable[..., Backend]  # (policy, settings, placement, collective_timeout_s) -> backend
    package: str | None  # the package it needs, checked before any compute
    install_hint: str
    whole_node: bool  # with one engine per node, every process of the node takes part in it
    shared: bool  # slow to start: `serve` keeps one per process
    own_weights: bool  # holds a copy of the weights (else it decodes with the policy's model)


def _hf(policy, settings: BackendSettings, placement=None,
        collective_timeout_s: float = 0.0) -> Backend:
    return HFBackend(policy.model, policy.tokenizer.pad_token_id, settings.max_batch_size,
                     settings.prefix_cache_mb)


def _vllm(policy, settings: BackendSettings, placement=None,
          collective_timeout_s: float = 3600.0) -> Backend:
    return VLLMBackend.from_policy(policy, placement=placement,
                                   collective_timeout_s=collective_timeout_s,
                                   **asdict(settings.vllm))


BACKENDS: dict[str, BackendSpec] = {
    "hf": BackendSpec(_hf, None, "", whole_node=False, shared=False, own_weights=False),
    "vllm": BackendSpec(_vllm, "vllm", INSTALL_HINT, whole_node=True, shared=True,
                        own_weights=True),
}


def spec(name: str) -> BackendSpec:
    if str(name) not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    return BACKENDS[str(name)]



def require_backend(name: str, key: str = "backend") -> None:
    """Raise `ConfigError` naming ``key`` and the install step if backend ``name`` cannot be
    built here (its package is missing): before any model is loaded (`BackendSettings.check`
    runs it, so a config's validation names its full key, ``rollout.backend``)."""
    package = spec(name).package
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"{key}={name}: {spec(name).install_hint}")


def build_backend(policy, settings: BackendSettings, **options: Any) -> Backend:
    """A new backend of ``settings.backend`` serving ``policy`` (``options``: a placement and a
    collective timeout, for training). The engine `serve` shares is released first: two
    engines never hold one GPU."""
    require_backend(settings.backend)
    if spec(settings.backend).shared:
        release_shared()
    return spec(settings.backend).build(policy, settings, **options)


class _Shared:
    """The one shared engine of this process, and the settings it was started under."""

    backend: Backend | None = None
    settings: BackendSettings | None = None


def serve(policy, settings: BackendSettings, exact: bool = True) -> Backend:
    """A backend of ``settings.backend`` serving ``policy``'s current weights: a new one for
    a backend cheap to start, else this process's shared engine (started, or restarted under
    other settings, as needed; with ``exact=False`` one of that backend runs under whatever
    settings it has), synced to the policy's weights unless it serves them already."""
    require_backend(settings.backend)
    if not spec(settings.backend).shared:
        return spec(settings.backend).build(policy, settings)
    running = _Shared.settings is not None and _Shared.settings.backend == settings.backend
    if not (running and (not exact or _Shared.settings == settings)):
        release_shared()
        _Shared.backend, _Shared.settings = spec(settings.backend).build(policy, settings), settings
    elif _Shared.backend.served != weights_stamp(policy.model):
        _Shared.backend.sync_weights(policy.model)
    return _Shared.backend


def release_shared() -> None:
    """Close this process's shared engine, if any."""
    if _Shared.backend is not None:
        _Shared.backend.close()
    _Shared.backend = _Shared.settings = None


atexit.register(release_shared)
