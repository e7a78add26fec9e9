"""The Trainer: the fit loop on top of one Engine (accumulation, clipping, validation, logging, periodic
checkpoints and exact resume, recovery from restarts), the :class:`Module` it trains, and the dispatch of its
events to callbacks and loggers. Torch is imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.trainer._trainer import Trainer
    from stratagem.trainer.module import Module

__all__ = ["Module", "Trainer"]

__getattr__ = lazy_getattr(
    __name__, {"Trainer": "stratagem.trainer._trainer", "Module": "stratagem.trainer.module"}, globals()
)
