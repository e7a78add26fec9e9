"""What a Trainer shows on rank 0: the progress display (step, loss and the other bar metrics, it/s, ETA) and
the lines it prints above it.

Refreshed on a timer, never per step: an update costs a clock read. On a terminal it is a rich progress bar;
elsewhere (logs, CI) a plain line every few seconds and one at the end.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stratagem.engine import Engine


def _format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "-:--:--"
    whole = round(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{name} {value:.4g}" for name, value in metrics.items())


class ProgressBar:
    def __init__(self, *, enabled: bool, refresh_s: float = 0.25, line_every_s: float = 5.0) -> None:
        self.enabled = enabled
        self._refresh_s = refresh_s
        self._line_every_s = line_every_s
        self._progress: Any = None
        self._task: Any = None
        self._metrics: dict[str, float] = {}
        self._next = 0.0
        self._last_line = 0.0
        self.total: int | None = None
        self.step = 0

    def start(self, *, total: int | None, step: int, description: str = "train") -> None:
        if not self.enabled:
            return
        self.total, self.step, self._start_step = total, step, step
        self._t0 = self._last_line = time.monotonic()
        self._description = description
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("step {task.completed}/{task.fields[total_text]}"),
                TextColumn("{task.fields[rate]}"),
                TextColumn("ETA {task.fields[eta]}"),
                TextColumn("{task.fields[metrics]}"),
                auto_refresh=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                description, total=total, completed=step, rate="", eta="", metrics="", total_text=total or "?"
            )

    def set_metrics(self, metrics: dict[str, float]) -> None:
        if self.enabled:
            self._metrics.update(metrics)

    def update(self, step: int, force: bool = False) -> None:
        if not self.enabled:
            return
        self.step = step
        now = time.monotonic()
        if now < self._next and not force:
            return
        self._next = now + self._refresh_s
        rate, eta = self._rate_eta(now)
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=step,
                rate=f"{rate:.2f} it/s",
                eta=_format_eta(eta),
                metrics=format_metrics(self._metrics),
            )
            self._progress.refresh()
        elif force or now - self._last_line >= self._line_every_s:
            self._last_line = now
            print(self.line(now), flush=True)

    def line(self, now: float | None = None) -> str:
        rate, eta = self._rate_eta(time.monotonic() if now is None else now)
        total = self.total if self.total is not None else "?"
        parts = [
            f"{self._description} step {self.step}/{total}",
            f"{rate:.2f} it/s",
            f"ETA {_format_eta(eta)}",
        ]
        if self._metrics:
            parts.append(format_metrics(self._metrics))
        return " | ".join(parts)

    def _rate_eta(self, now: float) -> tuple[float, float | None]:
        elapsed = max(now - self._t0, 1e-9)
        rate = (self.step - self._start_step) / elapsed
        eta = (self.total - self.step) / rate if self.total is not None and rate > 0 else None
        return rate, eta

    def print(self, message: str) -> None:
        """A line above the bar (validation results, notices); the caller decides which rank prints."""
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.update(self.step, force=True)
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class Console:
    """A Trainer's output: lines on rank 0 (above the bar while ``fit`` shows one), nothing in a process that
    only launches the workers; the bar of the current ``fit``."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.bar: ProgressBar | None = None

    def start_bar(self, *, enabled: bool, total: int | None, step: int) -> ProgressBar:
        self.bar = ProgressBar(enabled=enabled)
        self.bar.start(total=total, step=step)
        return self.bar

    def print(self, *args: Any) -> None:
        engine = self._engine
        if engine.needs_launch or not engine.is_global_zero:
            return
        message = " ".join(str(a) for a in args)
        if self.bar is not None and self.bar.enabled:
            self.bar.print(message)
        else:
            print(message, flush=True)
