"""The plan as a table: one row per strategy, the same cells for the terminal (``stratagem plan`` draws them
with rich) and for error messages (plain text). Torch-free."""

from __future__ import annotations

from typing import Any

from stratagem.planning._units import format_bytes

HEADERS = (
    "strategy",
    "rank",
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "total",
    "sends/step",
    "fits",
)


def _fits(strategy: Any, memory: int | None) -> str:
    if strategy.largest is None:
        return strategy.status
    if memory is None:
        return "-"
    return "yes" if strategy.fits else "no"


def rows(plan: Any) -> list[tuple[str, ...]]:
    """One tuple of cells per strategy, in :data:`HEADERS` order."""
    out = []
    for strategy in plan.strategies:
        largest = strategy.largest
        if largest is None:
            out.append((strategy.name, "-", "-", "-", "-", "-", "-", "-", strategy.status))
            continue
        out.append(
            (
                strategy.name,
                str(largest.rank),
                format_bytes(largest.parameters + largest.buffers),
                format_bytes(largest.gradients),
                format_bytes(largest.optimizer),
                format_bytes(largest.activations),
                format_bytes(largest.total),
                format_bytes(largest.communication),
                _fits(strategy, plan.memory),
            )
        )
    return out


def notes(plan: Any) -> list[str]:
    """What the table cannot say: why a strategy was not estimated, how an estimate was made."""
    out = []
    for strategy in plan.strategies:
        note = strategy.reason or (strategy.largest.note if strategy.largest is not None else "")
        if note:
            out.append(f"{strategy.name}: {note}")
    return out


def text_table(plan: Any) -> str:
    table = [HEADERS, *rows(plan)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADERS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]
    return "\n".join([*lines, *notes(plan)])
