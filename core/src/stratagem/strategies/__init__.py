"""Strategy base classes. Plugins subclass :class:`Strategy` or :class:`TorchDistributedStrategy`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

__all__ = ["SingleDeviceStrategy", "StepOutput", "Strategy", "TorchDistributedStrategy"]

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy
    from stratagem.strategies.single_device import SingleDeviceStrategy
    from stratagem.strategies.step import StepOutput
    from stratagem.strategies.torch_distributed import TorchDistributedStrategy

_LAZY = {
    "Strategy": "stratagem.strategies.base",
    "TorchDistributedStrategy": "stratagem.strategies.torch_distributed",
    "SingleDeviceStrategy": "stratagem.strategies.single_device",
    "StepOutput": "stratagem.strategies.step",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
