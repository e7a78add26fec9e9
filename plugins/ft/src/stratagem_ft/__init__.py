"""stratagem-ft: per-step fault tolerance on torchft.

Strategies ``ft_ddp``, ``ft_hsdp`` and ``diloco`` (:class:`FTDDPStrategy`, :class:`FTHSDPStrategy`,
:class:`DiLoCoStrategy`), and the ``replica_groups`` launcher (:class:`ReplicaGroupsLauncher`). Importing this
package imports neither torch nor torchft; the classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "DiLoCoConfig",
    "DiLoCoStrategy",
    "FTConfig",
    "FTDDPStrategy",
    "FTHSDPStrategy",
    "FTStrategy",
    "ReplicaGroupsLauncher",
]

if TYPE_CHECKING:
    from stratagem_ft._config import DiLoCoConfig, FTConfig
    from stratagem_ft.diloco import DiLoCoStrategy
    from stratagem_ft.launcher import ReplicaGroupsLauncher
    from stratagem_ft.strategy import FTDDPStrategy, FTHSDPStrategy, FTStrategy

_LAZY = {
    "FTConfig": "stratagem_ft._config",
    "DiLoCoConfig": "stratagem_ft._config",
    "FTStrategy": "stratagem_ft.strategy",
    "FTDDPStrategy": "stratagem_ft.strategy",
    "FTHSDPStrategy": "stratagem_ft.strategy",
    "DiLoCoStrategy": "stratagem_ft.diloco",
    "ReplicaGroupsLauncher": "stratagem_ft.launcher",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem_ft' has no attribute {name!r}")
