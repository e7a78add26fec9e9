"""What the Trainer reports: metrics logged during training and validation (reduced across ranks and sent to
the loggers at each logging step), and the validation and test loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from stratagem.engine.seed import capture_rng, restore_rng
from stratagem.trainer._model_calls import batch_for
from stratagem.trainer._progress import ProgressBar, format_metrics

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.registry._manager import TrainerEventHooks
    from stratagem.trainer._metrics import MetricStore
    from stratagem.trainer._options import TrainerOptions
    from stratagem.trainer._recovery import Recovery
    from stratagem.trainer._resume import Position


class Evaluation:
    """The Trainer's metric and validation methods; the Trainer holds the stores they fill."""

    options: TrainerOptions
    engine: Engine
    position: Position
    model: torch.nn.Module | None
    logged_metrics: dict[str, float]
    _events: TrainerEventHooks
    _recovery: Recovery
    _train_metrics: MetricStore
    _val_metrics: MetricStore
    _in_validation: bool
    _bar: ProgressBar | None
    _logging: bool

    def _log_metric(self, name: str, value: Any, *, prog_bar: bool, reduce: str) -> None:
        store = self._val_metrics if self._in_validation else self._train_metrics
        store.add(name, value, reduce=reduce, prog_bar=prog_bar)

    def _log_train_metrics(self) -> None:
        store = self._train_metrics
        if self._recovery.counts_restarts:
            store.add("restarts", self._recovery.restart_count, reduce="max", prog_bar=False)
        shown = set(store.prog_bar)
        values = store.reduce(self.engine)
        self.logged_metrics.update(values)
        self._write_metrics(values, self.position.epoch)
        assert self._bar is not None
        self._bar.set_metrics({k: v for k, v in values.items() if k in shown})

    def _write_metrics(self, values: dict[str, float], epoch: int) -> None:
        if self._logging and self.engine.is_global_zero:
            self._events.call(
                "log_metrics", trainer=self, metrics={"epoch": epoch, **values}, step=self.position.step
            )

    def _run_validation(self, loader: Any, epoch: int | None = None) -> dict[str, float]:
        return self._run_evaluation(loader, "validation", epoch)

    def _run_evaluation(self, loader: Any, stage: str, epoch: int | None = None) -> dict[str, float]:
        """``validation_step`` (``stage="validation"``: with its events and ``limit_val_batches``) or
        ``test_step`` over ``loader``; the metrics logged, reduced across ranks."""
        assert self.model is not None
        validating = stage == "validation"
        limit = self.options.limit_val_batches if validating else None
        was_training = self.model.training
        # Evaluation must not change the training's random stream (resume replays it exactly).
        rng = capture_rng()
        if validating:
            self._events.call("on_validation_start", trainer=self)
        self.model.eval()
        self._in_validation = True
        try:
            with torch.no_grad():
                for batch_idx, batch in enumerate(loader):
                    if limit is not None and batch_idx >= limit:
                        break
                    self._recovery.beat(self.position.step, self.position.batch_in_epoch, stage)
                    batch = batch_for(batch, self.engine.device, self.engine.precision)
                    with self.engine.forward_context():
                        self._call(f"{stage}_step", batch, batch_idx)
            values = self._val_metrics.reduce(self.engine)
        finally:
            self._in_validation = False
            self.model.train(was_training)
            restore_rng(rng)
        self.logged_metrics.update(values)
        if values:
            self._write_metrics(values, self.position.epoch if epoch is None else epoch)
            self.print(f"{stage} at step {self.position.step}: {format_metrics(values)}")
        if validating:
            self._events.call("on_validation_end", trainer=self, metrics=dict(values))
        return values
