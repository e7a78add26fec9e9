"""What to run: the columns of ``stratagem compare`` (a strategy name, optionally with options) and the job."""

from __future__ import annotations

from typing import Any

import attrs

from stratagem.errors import ConfigurationError
from stratagem.registry._labels import parse_label, split_top_level


@attrs.frozen
class Column:
    """One column of the table: a registered strategy and the options it is created with.

    ``label`` is how the user wrote it: ``fsdp``, ``fsdp[SHARD_GRAD_OP]``, ``ddp[static_graph=true]``.
    """

    label: str
    strategy: str
    options: dict[str, Any] = attrs.field(factory=dict, hash=False)


def parse_columns(text: str) -> list[Column]:
    """Parse ``--strategies``: comma-separated names, each optionally followed by ``[options]`` (see
    :func:`stratagem.registry._labels.parse_label`)."""
    columns: list[Column] = []
    for item in split_top_level(text):
        name, options = parse_label(item, "--strategies")
        if any(c.label == item for c in columns):
            raise ConfigurationError(f"--strategies: {item!r} is listed twice.")
        columns.append(Column(label=item, strategy=name, options=options))
    if not columns:
        raise ConfigurationError("--strategies: name at least one strategy (see `stratagem strategies`).")
    return columns


@attrs.frozen(kw_only=True)
class Job:
    """What every column runs: the same model, data and number of steps."""

    model: str
    steps: int
    batch_size: int
    warmup: int
    seed: int
    accelerator: str
    devices: int
    progress_path: str = ""


def default_warmup(steps: int) -> int:
    """Steps left out of the iterations-per-second figure (allocation, first collectives)."""
    return max(1, min(3, steps // 5)) if steps > 1 else 0
