"""``single_device``: one process, one device; every hook real."""

from __future__ import annotations

from stratagem.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Train in this process on ``cluster.device``. The reference for every equivalence check."""
