"""What the metric-watching callbacks share: checking ``mode``, finding the monitored value (or saying which
metrics exist), and comparing values."""

from __future__ import annotations

import difflib
import math
from typing import Any

from stratagem.errors import ConfigurationError

MODES = ("min", "max")


def check_mode(owner: str, mode: Any) -> str:
    if mode not in MODES:
        raise ConfigurationError(
            f"{owner}(mode={mode!r}): use 'min' (lower is better, a loss) or 'max' (higher is better, accuracy)."
        )
    return mode


def monitored_value(owner: str, monitor: str, metrics: dict[str, float], trainer: Any) -> float:
    """``monitor``'s value: from ``metrics`` (this validation), else the latest logged one; an error naming the
    metrics that exist when there is none."""
    if monitor in metrics:
        return float(metrics[monitor])
    if monitor in trainer.logged_metrics:
        return float(trainer.logged_metrics[monitor])
    existing = sorted(set(metrics) | set(trainer.logged_metrics))
    close = difflib.get_close_matches(monitor, existing, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigurationError(
        f"{owner}(monitor={monitor!r}): no metric {monitor!r} has been logged by step {trainer.global_step}.{hint} "
        f"Logged metrics: {', '.join(existing) or '(none)'}. Log it with self.log({monitor!r}, value) in "
        "validation_step, or monitor one of those."
    )


def better(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` improves on ``best`` by more than ``min_delta`` (NaN never does)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta
