"""Running in the parent: one launch per column, progress on the terminal, and the results."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from stratagem.cli.compare._columns import Column, Job, default_warmup
from stratagem.cli.compare._measuring import _measure, _write_progress
from stratagem.cli.compare._model_choice import load_model_factory
from stratagem.errors import ConfigurationError


@attrs.frozen(kw_only=True)
class ColumnResult:
    column: Column
    ranks: list[dict[str, Any]]
    warmup: int
    wall_s: float

    @property
    def timed_steps(self) -> list[float]:
        times = self.ranks[0]["step_times_s"]
        return times[self.warmup :] or times

    @property
    def iterations_per_second(self) -> float:
        return len(self.timed_steps) / sum(self.timed_steps)

    def largest(self, key: str) -> float | None:
        values = [r[key] for r in self.ranks if r.get(key) is not None]
        return max(values) if values else None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.column.label,
            "strategy": self.column.strategy,
            "options": self.column.options,
            "iterations_per_second": self.iterations_per_second,
            "median_step_s": statistics.median(self.timed_steps),
            "warmup_steps": self.warmup,
            "wall_s": self.wall_s,
            "ranks": self.ranks,
        }


def check_columns(columns: Sequence[Column], accelerator: str, devices: int) -> None:
    """Fail before launching anything: unknown names, capabilities, missing dependencies, bad options."""
    from stratagem.registry._manager import get_registry

    registry = get_registry()
    for column in columns:
        info = registry.check_request(
            column.strategy, accelerator=accelerator, precision="32-true", world_size=devices
        )
        if column.options:
            try:
                info.create(**column.options)
            except (TypeError, ValueError) as error:
                raise ConfigurationError(
                    f"--strategies {column.label!r}: {column.strategy} does not take these options: {error}"
                ) from error


class _Progress:
    """A bar in the launching process: which column runs, and its steps (rank 0 writes them to a file)."""

    def __init__(self, columns: Sequence[Column], steps: int, enabled: bool) -> None:
        self.columns, self.steps, self.enabled = columns, steps, enabled
        self._rich: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.path = ""

    def __enter__(self) -> _Progress:
        if not self.enabled:
            return self
        handle, self.path = tempfile.mkstemp(prefix="stratagem-compare-", suffix=".step")
        os.close(handle)
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._rich.start()
            self._overall = self._rich.add_task("strategies", total=len(self.columns))
            self._steps = self._rich.add_task("", total=self.steps, visible=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self._end_poll()
        if self._rich is not None:
            self._rich.stop()
        if self.path:
            with_suppress(os.remove, self.path)

    def start(self, index: int, column: Column) -> None:
        self._t0 = time.monotonic()
        if not self.enabled:
            return
        _write_progress(self.path, "0")
        if self._rich is None:
            print(
                f"compare [{index + 1}/{len(self.columns)}] {column.label} ...", file=sys.stderr, flush=True
            )
            return
        self._rich.update(self._steps, description=f"{column.label} steps", completed=0, visible=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                done = int(Path(self.path).read_text() or 0)
            except (OSError, ValueError):
                continue
            self._rich.update(self._steps, completed=done)

    def _end_poll(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finish(self, column: Column) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self._t0
        if self._rich is None:
            print(f"compare {column.label}: done in {elapsed:.1f} s", file=sys.stderr, flush=True)
            return
        self._end_poll()
        self._rich.update(self._steps, completed=self.steps)
        self._rich.advance(self._overall)


def with_suppress(function: Callable[..., Any], *args: Any) -> None:
    try:
        function(*args)
    except OSError:
        pass


def run(
    columns: Sequence[Column],
    *,
    model: str = "medium",
    steps: int = 20,
    devices: int = 2,
    accelerator: str = "auto",
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> list[ColumnResult]:
    """Run every column, one launch after the other, and return their measurements."""
    from stratagem.launchers import _worker_start
    from stratagem.launchers.cluster import resolve_accelerator

    for name, value in (("--steps", steps), ("--devices", devices), ("--batch-size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} {value!r}: give a positive number.")
    accelerator = resolve_accelerator(accelerator)
    load_model_factory(model)  # a bad --model fails here, not in every worker
    check_columns(columns, accelerator, devices)
    warmup = default_warmup(steps)
    results = []
    with _Progress(columns, steps, progress) as bar:
        for index, column in enumerate(columns):
            job = Job(
                model=model,
                steps=steps,
                batch_size=batch_size,
                warmup=warmup,
                seed=seed,
                accelerator=accelerator,
                devices=devices,
                progress_path=bar.path,
            )
            bar.start(index, column)
            start = time.perf_counter()
            per_rank = _worker_start.launch_function(
                _measure, (column, job), nproc_per_node=devices, accelerator=accelerator
            )
            wall = time.perf_counter() - start
            bar.finish(column)
            ranks = [per_rank[r] for r in sorted(per_rank)]
            results.append(ColumnResult(column=column, ranks=ranks, warmup=warmup, wall_s=wall))
    return results
