"""stratagem-deepspeed: DeepSpeed's ZeRO stages 1, 2 and 3 (with CPU offload) as stratagem strategies.

Importing this package imports neither torch nor deepspeed; :class:`DeepSpeedStrategy`,
:class:`DeepSpeedConfig`, :func:`consolidate` and ``CONFIG_ENV`` load on first use (the listing imports this
package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CONFIG_ENV", "DeepSpeedConfig", "DeepSpeedStrategy", "consolidate"]

if TYPE_CHECKING:
    from stratagem_deepspeed._config import CONFIG_ENV, DeepSpeedConfig
    from stratagem_deepspeed._offline import consolidate
    from stratagem_deepspeed.strategy import DeepSpeedStrategy

_LAZY = {
    "CONFIG_ENV": "stratagem_deepspeed._config",
    "DeepSpeedStrategy": "stratagem_deepspeed.strategy",
    "DeepSpeedConfig": "stratagem_deepspeed._config",
    "consolidate": "stratagem_deepspeed._offline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem_deepspeed' has no attribute {name!r}")
