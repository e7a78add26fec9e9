"""One batch's forward and backward (or forward only) under any strategy, so that one custom loop runs under every
strategy, pipelines included: ``Engine.train_batch`` and ``Engine.eval_batch``.

A strategy that owns the step (``run_training_batch`` returns a result) runs it; for the others the Engine
runs the ordinary path: ``forward_context``, the model, the loss function, then ``backward``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from stratagem.strategies.step import StepOutput, as_inputs, given_split, scalar_loss

if TYPE_CHECKING:
    from stratagem.engine._model_setup import ModelSetup
    from stratagem.engine._strategy_runtime import StrategyRuntime


class BatchSteps:
    """``Engine.train_batch`` and ``Engine.eval_batch`` (documented there): the strategy's own run of the batch
    when it has one, else the ordinary path through its hooks."""

    def __init__(self, runtime: StrategyRuntime, models: ModelSetup) -> None:
        self._runtime = runtime
        self._models = models

    def train_batch(
        self,
        model: torch.nn.Module | None,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_scale: float,
    ) -> StepOutput:
        model = self._models.model_for(model)
        args = as_inputs(inputs)
        hooks = self._runtime.hooks
        owned = hooks.run_training_batch(model, (args, targets), 0, given_split, loss_fn, loss_scale)
        if owned is not None:
            return owned
        with hooks.forward_context():
            outputs = model(*args)
            loss = scalar_loss(loss_fn(outputs, targets), "loss_fn")
        hooks.backward(loss * loss_scale if loss_scale != 1.0 else loss, model)
        return StepOutput(loss=loss.detach(), outputs=outputs)

    def eval_batch(
        self,
        model: torch.nn.Module | None,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> StepOutput:
        model = self._models.model_for(model)
        args = as_inputs(inputs)
        wanted = loss_fn if targets is not None else None
        hooks = self._runtime.hooks
        with torch.no_grad():
            owned = hooks.run_evaluation_batch(model, (args, targets), 0, given_split, wanted, "validation")
            if owned is not None:
                return owned
            with hooks.forward_context():
                outputs = model(*args)
                loss = None if wanted is None else scalar_loss(wanted(outputs, targets), "loss_fn")
        return StepOutput(loss=loss, outputs=outputs)
