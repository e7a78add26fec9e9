"""stratagem-tp: tensor parallelism (``torch.distributed.tensor.parallel``) as the stratagem strategies ``tp``
and ``fsdp_tp``.

Importing this package does not import torch; the classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["STYLE_NAMES", "FSDPTPStrategy", "TPConfig", "TPStrategy"]

if TYPE_CHECKING:
    from stratagem_tp._config import TPConfig
    from stratagem_tp._styles import STYLE_NAMES
    from stratagem_tp.strategy import FSDPTPStrategy, TPStrategy

_LAZY = {
    "TPStrategy": "stratagem_tp.strategy",
    "FSDPTPStrategy": "stratagem_tp.strategy",
    "TPConfig": "stratagem_tp._config",
    "STYLE_NAMES": "stratagem_tp._styles",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem_tp' has no attribute {name!r}")
