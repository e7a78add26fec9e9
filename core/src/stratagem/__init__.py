"""stratagem: pick how training is spread over processes by a name.

``import stratagem`` is cheap: torch and the training classes load on first use.

The packages, bottom layer first (``docs/architecture.md``): ``errors`` and ``hookspecs`` (the contract),
``registry`` (plugin discovery), ``checkpoint``, ``launchers`` (starting, watching and restarting workers),
``strategies``, ``engine``, ``trainer``, ``callbacks`` and ``loggers``, ``contract`` (the certification suite),
``cli``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

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


#: Module paths from before the core was grouped into packages, which plugins and documentation name. Each
#: still imports, as the same module object as its new home (``stratagem.testing.plugin`` *is*
#: ``stratagem.contract.plugin``), and only when asked for.
MOVED_MODULES = {
    "stratagem.testing": "stratagem.contract",
    "stratagem.wrapping": "stratagem.strategies.wrapping",
    "stratagem.precision": "stratagem.strategies.precision",
    "stratagem.capabilities": "stratagem.registry.capabilities",
    "stratagem.cluster": "stratagem.launchers.cluster",
    "stratagem.launcher": "stratagem.launchers._spawn",
    "stratagem.module": "stratagem.trainer.module",
    "stratagem.seed": "stratagem.engine.seed",
    "stratagem.data": "stratagem.engine.data",
}


def _new_home(name: str) -> str | None:
    for old, new in MOVED_MODULES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _MovedModuleFinder:
    """Finds an old module path and hands back the module at its new one (imported there, under its own name)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = _new_home(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(_new_home(spec.name))  # type: ignore[arg-type]
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # The import system set the alias's spec on the module; it keeps its own.
        module.__spec__ = self._own_spec


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())
