"""What the built-in loggers share: the directory they write under and starting their run once, on rank 0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stratagem.hookspecs import hookimpl


class RankZeroLogger:
    """Base of the built-in loggers: :meth:`start` opens the run at ``log_hyperparams`` (which only global
    rank 0 receives), :meth:`write` records metrics, :meth:`close` ends the run; ranks that never started do
    nothing at the end of ``fit``."""

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.started = False

    def directory(self, trainer: Any) -> Path:
        if self.save_dir is not None:
            return Path(self.save_dir)
        from stratagem.checkpoint._store import local_dir

        # A run on an object store keeps its local files under ./runs/<scheme>/<bucket>/<prefix>.
        return local_dir(trainer.default_root_dir)

    def start(self, trainer: Any, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def write(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, failed: bool) -> None:
        """End the run; ``failed`` when ``fit`` raised."""

    @hookimpl
    def log_hyperparams(self, trainer: Any, params: dict[str, Any]) -> None:
        if self.started:
            self.close(failed=False)
        self.start(trainer, params)
        self.started = True

    @hookimpl
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.started:
            self.write(metrics, step)

    @hookimpl
    def on_fit_end(self) -> None:
        if self.started:
            self.started = False
            self.close(failed=False)

    @hookimpl
    def on_exception(self) -> None:
        if self.started:
            self.started = False
            self.close(failed=True)
