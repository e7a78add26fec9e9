"""Progress of a long read or write on rank 0, and every rank failing together when one rank fails."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from stratagem.errors import CheckpointError


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    """Bytes done out of ``total``: a bar on a terminal, else a line every 10 s; nothing for work shorter
    than 2 s, or where ``enabled`` is false (ranks other than 0)."""

    def __init__(self, what: str, total: int, *, enabled: bool) -> None:
        self.what, self.total, self.done = what, total, 0
        self.enabled = enabled and total > 0
        self._start = self._last = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._start < 2.0:
            return
        if self._bar is None and sys.stdout.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self._bar = Progress(TextColumn(self.what), BarColumn(), DownloadColumn(), TransferSpeedColumn())
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        elif now - self._last >= 10.0:
            self._last = now
            print(f"{self.what}: {size_text(self.done)} of {size_text(self.total)}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            self._bar.stop()
            self._bar = None


def agree(strategy: Any, where: Any, error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed (a collective: every rank calls it at the same point), with each
    failing rank's error; a single process re-raises its own."""
    if strategy.world_size == 1:
        if error is not None:
            raise error
        return
    failed = strategy.all_reduce(torch.tensor([0.0 if error is None else 1.0]), "max")
    if float(failed[0]) == 0.0:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    messages = [strategy.broadcast(mine, src) for src in range(strategy.world_size)]
    if isinstance(error, CheckpointError) and messages.count(mine) == len(messages):
        raise error  # the same on every rank (a mismatch): as it is
    ranks: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message is not None:
            ranks.setdefault(message, []).append(rank)
    detail = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in ranks.items()
    )
    raise CheckpointError(where, f"{what} failed ({detail}).") from error
