"""stratagem: pick how training is spread over processes by a name.

``import stratagem`` is cheap: torch and the training classes load on first use.

The packages, bottom layer first (``docs/architecture.md``): ``errors`` and ``hookspecs`` (the contract),
``registry`` (plugin discovery), ``checkpoint``, ``launchers`` (starting, watching and restarting workers),
``strategies``, ``engine``, ``trainer``, ``callbacks`` and ``loggers``, ``contract`` (the certification suite),
``cli``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.errors import (
    CapabilityError,
    CheckpointError,
    ConfigurationError,
    HookImplementationError,
    MissingDependencyError,
    PluginLoadError,
    Preempted,
    StratagemError,
    StrategyConflictError,
    UnknownStrategyError,
    WorkerFailedError,
)
from stratagem.hookspecs import hookimpl, hookspec
from stratagem.registry._lazy import lazy_getattr
from stratagem.registry._version import __version__
from stratagem.registry.capabilities import Capabilities

if TYPE_CHECKING:
    from stratagem.checkpoint import PerRank
    from stratagem.engine import Engine
    from stratagem.engine.seed import seed_everything
    from stratagem.launchers.cluster import ClusterEnvironment
    from stratagem.registry._manager import get_registry
    from stratagem.strategies import SingleDeviceStrategy, Strategy, TorchDistributedStrategy
    from stratagem.strategies.wrapping import wrap
    from stratagem.trainer import Module, Trainer

__all__ = [
    "Capabilities",
    "CapabilityError",
    "CheckpointError",
    "ClusterEnvironment",
    "ConfigurationError",
    "Engine",
    "HookImplementationError",
    "MissingDependencyError",
    "Module",
    "PerRank",
    "PluginLoadError",
    "Preempted",
    "SingleDeviceStrategy",
    "StratagemError",
    "Strategy",
    "StrategyConflictError",
    "TorchDistributedStrategy",
    "Trainer",
    "UnknownStrategyError",
    "WorkerFailedError",
    "__version__",
    "get_registry",
    "hookimpl",
    "hookspec",
    "seed_everything",
    "wrap",
]

_LAZY = {
    "Engine": "stratagem.engine._engine",
    "Trainer": "stratagem.trainer._trainer",
    "Module": "stratagem.trainer.module",
    "PerRank": "stratagem.checkpoint",
    "ClusterEnvironment": "stratagem.launchers.cluster",
    "seed_everything": "stratagem.engine.seed",
    "Strategy": "stratagem.strategies",
    "TorchDistributedStrategy": "stratagem.strategies",
    "SingleDeviceStrategy": "stratagem.strategies",
    "get_registry": "stratagem.registry._manager",
    "wrap": "stratagem.strategies.wrapping",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
