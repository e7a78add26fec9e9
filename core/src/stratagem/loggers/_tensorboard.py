"""``tensorboard``: event files written with ``torch.utils.tensorboard.SummaryWriter`` (needs the
``tensorboard`` package: ``pip install "stratagem[tensorboard]"``)."""

from __future__ import annotations

from typing import Any

from stratagem.loggers._logger_base import RankZeroLogger


class TensorBoardLogger(RankZeroLogger):
    """Scalars (one tag per metric, at its step) and the hyperparameters (TensorBoard's HParams plugin) under
    ``save_dir/name`` (default ``default_root_dir/tensorboard``). A resumed run purges the events after the
    step it resumed from, so the curves do not fold back."""

    def __init__(self, save_dir: Any = None, name: str = "tensorboard", flush_secs: int = 30) -> None:
        super().__init__(save_dir)
        self.name = name
        self.flush_secs = flush_secs
        self.writer: Any = None

    def start(self, trainer: Any, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        log_dir = self.directory(trainer) / self.name
        purge = trainer.global_step if trainer.ckpt_path is not None else None
        self.writer = SummaryWriter(str(log_dir), purge_step=purge, flush_secs=self.flush_secs)
        # The HParams plugin wants str, bool or number values.
        values = {k: ("None" if v is None else v) for k, v in params.items()}
        experiment, session_start, session_end = hparams(values, {})
        file_writer = self.writer.file_writer
        for summary in (experiment, session_start, session_end):
            file_writer.add_summary(summary)

    def write(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
