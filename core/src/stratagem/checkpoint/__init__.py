"""Checkpoints: full (one ``torch.save`` file of plain tensors) and sharded (a ``torch.distributed.checkpoint``
directory plus ``stratagem.json``). Neither format ever needs pickled code to load.

For strategies that write a layout of their own, the building blocks are :mod:`stratagem.checkpoint.layouts`;
:func:`consolidate` turns a sharded checkpoint into a full one offline (``stratagem checkpoint consolidate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.checkpoint._state_layout import FORMAT_VERSION, METADATA_FILE, PerRank
from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.checkpoint._offline import consolidate

__all__ = ["FORMAT_VERSION", "METADATA_FILE", "PerRank", "consolidate"]

__getattr__ = lazy_getattr(__name__, {"consolidate": "stratagem.checkpoint._offline"}, globals())
