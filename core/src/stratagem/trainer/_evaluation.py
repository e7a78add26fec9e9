"""What the Trainer reports: metrics logged during training and validation (reduced across ranks and sent to
the loggers at each logging step), and the validation and test loop."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from stratagem.engine.seed import capture_rng, restore_rng
from stratagem.errors import ConfigurationError
from stratagem.trainer._model_calls import batch_for
from stratagem.trainer._progress import ProgressBar, format_metrics
from stratagem.trainer.module import Module, defines_loss, step_functions

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.registry._event_hooks import TrainerEventHooks
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
    module: Any
    logged_metrics: dict[str, float]
    _events: TrainerEventHooks
    _recovery: Recovery
    _train_metrics: MetricStore
    _val_metrics: MetricStore
    _in_validation: bool
    _bar: ProgressBar | None
    _logging: bool
    _owned_step: bool

    def _call(self, method: str, *args: Any) -> Any:  # the Trainer's
        raise NotImplementedError

    def _log_metric(self, name: str, value: Any, *, prog_bar: bool, reduce: str) -> None:
        if self._owned_step:
            raise ConfigurationError(
                f"log({name!r}) inside compute_loss or split_batch while strategy {self.engine.strategy_name!r} "
                "runs the step itself: they run on some ranks only (a pipeline's last stage), and logging is "
                "reduced over every rank. Log from a callback's on_train_batch_end (outputs is the loss there)."
            )
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

    def _evaluate_batch(self, batch: Any, batch_idx: int, stage: str) -> Any:
        """One batch of ``stage`` (``"validation"``, ``"test"``, ``"predict"``), under ``torch.no_grad()`` with
        the model in eval mode: the strategy's own forward-only run when it has one (a pipeline; its loss is
        logged as ``val_loss`` / ``test_loss`` when the module defines one), else the module's ``<stage>_step``
        through the wrapped model. Returns what the step returned, or the strategy's outputs (on the ranks that
        hold them)."""
        module = self.module
        split_batch, compute_loss = step_functions(module)
        wanted = compute_loss if stage != "predict" and defines_loss(module) else None
        self._owned_step = True
        try:
            owned = self.engine.run_evaluation_batch(self.model, batch, batch_idx, split_batch, wanted, stage)
        finally:
            self._owned_step = False
        if owned is None:
            with self.engine.forward_context():
                return self._call(f"{stage}_step", batch, batch_idx)
        if batch_idx == 0 and self.engine.is_global_zero and _overrides(module, f"{stage}_step"):
            warnings.warn(
                f"{type(module).__name__}.{stage}_step is not called: strategy {self.engine.strategy_name!r} runs "
                "forward itself (over its stages)"
                + (
                    "; its outputs are the predictions."
                    if stage == "predict"
                    else "; the loss from compute_loss is logged instead."
                ),
                stacklevel=2,
            )
        if owned.loss is not None:
            self._log_metric(f"{_PREFIXES.get(stage, stage)}_loss", owned.loss, prog_bar=True, reduce="mean")
        return owned.outputs

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
                    self._evaluate_batch(batch, batch_idx, stage)
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


#: The metric prefix of each evaluation stage's loss.
_PREFIXES = {"validation": "val", "test": "test"}


def _overrides(module: Any, method: str) -> bool:
    own = getattr(type(module), method, None)
    return own is not None and own is not getattr(Module, method, None)
