"""stratagem-fsdp: FSDP2 (``torch.distributed.fsdp.fully_shard``) as stratagem strategies.

Importing this package does not import torch; :class:`FSDPStrategy` and :class:`FSDPConfig` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["FSDPConfig", "FSDPStrategy"]

if TYPE_CHECKING:
    from stratagem_fsdp._config import FSDPConfig
    from stratagem_fsdp.strategy import FSDPStrategy

_LAZY = {"FSDPStrategy": "stratagem_fsdp.strategy", "FSDPConfig": "stratagem_fsdp._config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem_fsdp' has no attribute {name!r}")
