"""stratagem-deepspeed: DeepSpeed's ZeRO stages 1, 2 and 3 (with CPU offload) as stratagem strategies.

Importing this package imports neither torch nor deepspeed; :class:`DeepSpeedStrategy`,
:class:`DeepSpeedConfig` and :func:`consolidate` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CONFIG_ENV", "DeepSpeedConfig", "DeepSpeedStrategy", "consolidate"]

from stratagem_deepspeed._config import CONFIG_ENV

if TYPE_CHECKING:
    from stratagem_deepspeed._config import DeepSpeedConfig
    from stratagem_deepspeed._offline import consolidate
    from stratagem_deepspeed.strategy import DeepSpeedStrategy

_LAZY = {
    "DeepSpeedStrategy": "stratagem_deepspeed.strategy",
    "DeepSpeedConfig": "stratagem_deepspeed._config",
    "consolidate": "stratagem_deepspeed._offline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem_deepspeed' has no attribute {name!r}")
