"""stratagem-pp: pipeline parallelism (``torch.distributed.pipelining``) as the stratagem strategies ``pp``,
``pp_fsdp`` and ``pp_fsdp_tp``.

Importing this package does not import torch; the classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "SCHEDULES",
    "PPConfig",
    "PPFSDPStrategy",
    "PPFSDPTPStrategy",
    "PPStrategy",
    "Skipped",
    "Split",
]

if TYPE_CHECKING:
    from stratagem_pp._config import PPConfig
    from stratagem_pp._schedules import SCHEDULES
    from stratagem_pp._split import Split
    from stratagem_pp._stage import Skipped
    from stratagem_pp.strategy import PPFSDPStrategy, PPFSDPTPStrategy, PPStrategy

_LAZY = {
    "PPStrategy": "stratagem_pp.strategy",
    "PPFSDPStrategy": "stratagem_pp.strategy",
    "PPFSDPTPStrategy": "stratagem_pp.strategy",
    "PPConfig": "stratagem_pp._config",
    "SCHEDULES": "stratagem_pp._schedules",
    "Split": "stratagem_pp._split",
    "Skipped": "stratagem_pp._stage",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stratagem_pp' has no attribute {name!r}")
