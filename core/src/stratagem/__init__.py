"""stratagem: pick how training is spread over processes by a name.

``import stratagem`` is cheap: torch and the training classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stratagem._version import __version__
from stratagem.capabilities import Capabilities
from stratagem.errors import (
    CapabilityError,
    CheckpointError,
    ConfigurationError,
    HookImplementationError,
    MissingDependencyError,
    PluginLoadError,
    StratagemError,
    StrategyConflictError,
    UnknownStrategyError,
    WorkerFailedError,
)
from stratagem.hookspecs import hookimpl, hookspec
from stratagem.wrapping import wrap

if TYPE_CHECKING:
    from stratagem.checkpoint import PerRank
    from stratagem.engine import Engine
    from stratagem.module import Module
    from stratagem.seed import seed_everything
    from stratagem.strategies import SingleDeviceStrategy, Strategy, TorchDistributedStrategy
    from stratagem.trainer import Trainer

__all__ = [
    "Capabilities",
    "CapabilityError",
    "CheckpointError",
    "ConfigurationError",
    "Engine",
    "HookImplementationError",
    "MissingDependencyError",
    "Module",
    "PerRank",
    "PluginLoadError",
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
    "Engine": "stratagem.engine",
    "Trainer": "stratagem.trainer",
    "Module": "stratagem.module",
    "PerRank": "stratagem.checkpoint",
    "seed_everything": "stratagem.seed",
    "Strategy": "stratagem.strategies",
    "TorchDistributedStrategy": "stratagem.strategies",
    "SingleDeviceStrategy": "stratagem.strategies",
    "get_registry": "stratagem._manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stratagem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
