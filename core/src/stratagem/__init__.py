"""stratagem: pick how training is spread over processes by a name.

``import stratagem`` is cheap: torch and the training classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem._lazy import lazy_getattr
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


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
