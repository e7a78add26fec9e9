"""Small helpers shared by the benchmark scripts (timing, tables). Not part of any package."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Sequence


def time_command(argv: Sequence[str], repeats: int, env: dict[str, str] | None = None) -> list[float]:
    """Wall-clock seconds of ``repeats`` runs of a command (after one warm-up run)."""
    subprocess.run(argv, check=True, capture_output=True, env=env)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def python() -> str:
    return sys.executable
