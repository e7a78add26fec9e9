"""Strategy base classes. Plugins subclass :class:`Strategy` or :class:`TorchDistributedStrategy`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["SingleDeviceStrategy", "Strategy", "TorchDistributedStrategy"]

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy
    from stratagem.strategies.single_device import SingleDeviceStrategy
    from stratagem.strategies.torch_distributed import TorchDistributedStrategy

_LAZY = {
    "Strategy": "stratagem.strategies.base",
    "TorchDistributedStrategy": "stratagem.strategies.torch_distributed",
    "SingleDeviceStrategy": "stratagem.strategies.single_device",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package (as the built-in plugin does) does not import torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem.strategies' has no attribute {name!r}")
