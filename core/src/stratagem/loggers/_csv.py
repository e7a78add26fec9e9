"""``csv``: ``metrics.csv`` (one row per logging step and per validation) and ``hparams.json``."""

from __future__ import annotations

import json
from typing import Any

from stratagem.loggers._logger_base import RankZeroLogger
from stratagem.trainer._metrics import CsvLog


class CSVLogger(RankZeroLogger):
    """Write ``metrics.csv`` and ``hparams.json`` under ``save_dir`` (default: the Trainer's
    ``default_root_dir``). A resumed run keeps the rows up to the step it resumed from."""

    def __init__(self, save_dir: Any = None) -> None:
        super().__init__(save_dir)
        self._log: CsvLog | None = None

    def start(self, trainer: Any, params: dict[str, Any]) -> None:
        directory = self.directory(trainer)
        directory.mkdir(parents=True, exist_ok=True)
        self._log = CsvLog(directory / "metrics.csv", enabled=True)
        if trainer.ckpt_path is not None:
            self._log.resume_after(trainer.global_step)
        else:
            self._log.start_fresh()
        (directory / "hparams.json").write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")

    def write(self, metrics: dict[str, float], step: int) -> None:
        assert self._log is not None
        self._log.write({"step": step, **metrics})
