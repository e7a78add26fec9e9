"""stratagem-ddp: ``torch.nn.parallel.DistributedDataParallel`` as a stratagem strategy.

Importing this package does not import torch; :class:`DDPStrategy` and :class:`DDPConfig` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["DDPConfig", "DDPStrategy"]

if TYPE_CHECKING:
    from stratagem_ddp._config import DDPConfig
    from stratagem_ddp.strategy import DDPStrategy

_LAZY = {"DDPStrategy": "stratagem_ddp.strategy", "DDPConfig": "stratagem_ddp._config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem_ddp' has no attribute {name!r}")
