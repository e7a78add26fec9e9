"""The Engine: a chosen strategy's operations for a hand-written loop (launch, set up, backward, step, save and
load, collectives). The Trainer is built on it. Torch is imported on first use of :class:`Engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.engine._defaults import (
    COMPILE_ENV,
    DEFAULT_LAUNCHER,
    DEFAULT_TIMEOUT_S,
    LAUNCHER_ENV,
    STRATEGY_ENV,
)
from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.engine._engine import Engine

__all__ = ["COMPILE_ENV", "DEFAULT_LAUNCHER", "DEFAULT_TIMEOUT_S", "LAUNCHER_ENV", "STRATEGY_ENV", "Engine"]


__getattr__ = lazy_getattr(__name__, {"Engine": "stratagem.engine._engine"}, globals())
