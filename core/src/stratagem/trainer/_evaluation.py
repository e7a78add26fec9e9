"""The Trainer's evaluation loops: validation (during ``fit`` and by ``validate``), ``test`` and ``predict`` over
a loader, each batch through the module's ``*_step`` or the strategy's own forward-only run, with the model in
eval mode and the training's random stream left as it was."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from stratagem.engine.seed import capture_rng, restore_rng
from stratagem.trainer import _predictions
from stratagem.trainer._model_calls import batch_for, call_step
from stratagem.trainer._progress import format_metrics
from stratagem.trainer.module import Module, defines_loss, step_functions

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.trainer._callbacks_and_loggers import TrainerEvents
    from stratagem.trainer._metrics import RunMetrics
    from stratagem.trainer._progress import Console
    from stratagem.trainer._recovery import Recovery
    from stratagem.trainer._run_state import RunState


class Evaluator:
    """Runs the model of ``run`` over evaluation loaders; what it logs goes to ``metrics``."""

    def __init__(
        self,
        engine: Engine,
        run: RunState,
        metrics: RunMetrics,
        events: TrainerEvents,
        recovery: Recovery,
        console: Console,
    ) -> None:
        self._engine, self._run, self._metrics = engine, run, metrics
        self._events, self._recovery, self._console = events, recovery, console

    def evaluate_batch(self, batch: Any, batch_idx: int, stage: str) -> Any:
        """One batch of ``stage`` (``"validation"``, ``"test"``, ``"predict"``), under ``torch.no_grad()`` with
        the model in eval mode: the strategy's own forward-only run when it has one (a pipeline; its loss is
        logged as ``val_loss`` / ``test_loss`` when the module defines one), else the module's ``<stage>_step``
        through the wrapped model. Returns what the step returned, or the strategy's outputs (on the ranks that
        hold them)."""
        engine, module, model = self._engine, self._run.module, self._run.model
        split_batch, compute_loss = step_functions(module)
        wanted = compute_loss if stage != "predict" and defines_loss(module) else None
        with self._metrics.strategy_step():
            owned = engine.run_evaluation_batch(model, batch, batch_idx, split_batch, wanted, stage)
        if owned is None:
            with engine.forward_context():
                return call_step(model, module, f"{stage}_step", batch, batch_idx)
        if batch_idx == 0 and engine.is_global_zero and _overrides(module, f"{stage}_step"):
            warnings.warn(
                f"{type(module).__name__}.{stage}_step is not called: strategy {engine.strategy_name!r} runs "
                "forward itself (over its stages)"
                + (
                    "; its outputs are the predictions."
                    if stage == "predict"
                    else "; the loss from compute_loss is logged instead."
                ),
                stacklevel=2,
            )
        if owned.loss is not None:
            self._metrics.log(f"{_PREFIXES.get(stage, stage)}_loss", owned.loss, prog_bar=True, reduce="mean")
        return owned.outputs

    def validate(self, loader: Any, epoch: int | None = None) -> dict[str, float]:
        return self.run(loader, "validation", epoch)

    def run(self, loader: Any, stage: str, epoch: int | None = None) -> dict[str, float]:
        """``validation_step`` (``stage="validation"``: with its events and ``limit_val_batches``) or
        ``test_step`` over ``loader``; the metrics logged, reduced across ranks."""
        engine, model, position = self._engine, self._run.model, self._run.position
        assert model is not None
        validating = stage == "validation"
        limit = self._run.options.limit_val_batches if validating else None
        was_training = model.training
        # Evaluation must not change the training's random stream (resume replays it exactly).
        rng = capture_rng()
        if validating:
            self._events.call("on_validation_start")
        model.eval()
        try:
            with self._metrics.evaluating(), torch.no_grad():
                for batch_idx, batch in enumerate(loader):
                    if limit is not None and batch_idx >= limit:
                        break
                    self._recovery.beat(position.step, position.batch_in_epoch, stage)
                    batch = batch_for(batch, engine.device, engine.precision)
                    self.evaluate_batch(batch, batch_idx, stage)
                values = self._metrics.evaluation.reduce(engine)
        finally:
            model.train(was_training)
            restore_rng(rng)
        self._metrics.logged.update(values)
        if values:
            self._metrics.write(values, position.epoch if epoch is None else epoch)
            self._console.print(f"{stage} at step {position.step}: {format_metrics(values)}")
        if validating:
            self._events.call("on_validation_end", metrics=dict(values))
        return values

    def predict(self, loader: Any) -> list[Any]:
        """``predict_step`` (or the strategy's own forward-only run) over ``loader``: this process's
        predictions, on the CPU."""
        model = self._run.model
        assert model is not None
        was_training = model.training
        rng = capture_rng()
        model.eval()
        outputs = []
        try:
            with torch.no_grad():
                for batch_idx, batch in enumerate(loader):
                    batch = batch_for(batch, self._engine.device, self._engine.precision)
                    outputs.append(_predictions.to_cpu(self.evaluate_batch(batch, batch_idx, "predict")))
        finally:
            model.train(was_training)
            restore_rng(rng)
        return outputs


#: The metric prefix of each evaluation stage's loss.
_PREFIXES = {"validation": "val", "test": "test"}


def _overrides(module: Any, method: str) -> bool:
    own = getattr(type(module), method, None)
    return own is not None and own is not getattr(Module, method, None)
