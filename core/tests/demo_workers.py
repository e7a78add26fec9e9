"""Runs ``stratagem demo`` under several strategies inside one launch (importable by spawned workers)."""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The loggers whose records reach the terminal: the root's, and those that print on their own (torch's and
#: torch.distributed's have handlers and do not propagate; DeepSpeed's likewise).
PRINTING_LOGGERS = ("", "torch", "torch.distributed", "DeepSpeed")


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def warnings_printed(into: list[str]) -> Iterator[None]:
    """What a run prints as a warning, in this process: Python warnings that the filters in force let through
    (torch's and the plugins' own filters included) and log records at WARNING or above. (C++ warnings that
    torch prints outside Python, such as DDP's reducer's, are not seen here.)"""
    handler = _Collect(into)
    loggers = [logging.getLogger(name) for name in PRINTING_LOGGERS]
    with warnings.catch_warnings(record=True) as caught:
        for logger in loggers:
            logger.addHandler(handler)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
    into += [f"{w.category.__name__}: {w.message}" for w in caught]


def demo_under_each(names: list[str], root: str, steps: int, devices: int) -> dict[str, Any]:
    """``stratagem.cli.demo.lm.run`` for each strategy in turn, in the processes of one launch: each run makes its
    own Trainers (and process group) as the command would, and reports the warnings it printed. A failure is
    recorded and the next one runs."""
    from stratagem.cli.demo.lm import run

    results: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        printed: list[str] = []
        try:
            with warnings_printed(printed):
                report = run(
                    strategy=name,
                    devices=devices,
                    steps=steps,
                    root_dir=str(Path(root) / name),
                    progress_bar=False,
                )
        except Exception:
            report = {"error": traceback.format_exc()}
        report["seconds"] = time.perf_counter() - start
        report["warnings"] = printed
        results[name] = report
    return results
