"""Plugin discovery: the pluggy manager (the only code that calls ``pm.hook``), the registries of strategies,
launchers, callbacks and loggers found through entry points, what each declares (capabilities), the base of
every hook object, and names with options (``fsdp_tp[tensor_parallel_size=2]``). Imports nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.registry._manager import get_registry
    from stratagem.registry._registry import Registry
    from stratagem.registry.capabilities import Capabilities, LauncherCapabilities

__all__ = ["Capabilities", "LauncherCapabilities", "Registry", "get_registry"]

_LAZY = {
    "Capabilities": "stratagem.registry.capabilities",
    "LauncherCapabilities": "stratagem.registry.capabilities",
    "Registry": "stratagem.registry._registry",
    "get_registry": "stratagem.registry._manager",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
