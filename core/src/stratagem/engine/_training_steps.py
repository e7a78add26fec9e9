"""The Engine's step methods: ``backward``, ``clip_gradients``, ``no_sync``, and one batch's forward and backward
(or forward only) under any strategy, so that one custom loop runs under every strategy, pipelines included.

A strategy that owns the step (``run_training_batch`` returns a result) runs it; for the others the Engine
runs the ordinary path: ``forward_context``, the model, the loss function, then ``backward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ContextManager

import torch

from stratagem.engine._strategy_optimizer import _unwrap
from stratagem.errors import ConfigurationError
from stratagem.strategies.step import StepOutput, as_inputs, given_split, scalar_loss

if TYPE_CHECKING:
    from stratagem.registry._manager import StrategyHooks


class Steps:
    """Mixed into the Engine, which provides the hooks and the model lookup."""

    _hooks: StrategyHooks
    _models: list[torch.nn.Module]

    def _model_for(self, model: torch.nn.Module | None) -> torch.nn.Module:
        if model is not None:
            return model
        if len(self._models) != 1:
            raise ConfigurationError("Several models are set up: pass the one this call is for (model=...).")
        return self._models[0]

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None = None) -> None:
        self._hooks.backward(loss, self._model_for(model))

    def clip_gradients(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        return self._hooks.clip_gradients(model, _unwrap(optimizer), float(max_norm))

    def no_sync(self, model: torch.nn.Module | None = None, enabled: bool = True) -> ContextManager[None]:
        """Skip gradient synchronisation inside the block (accumulation steps) when ``enabled``."""
        if not enabled:
            return contextlib.nullcontext()
        return self._hooks.no_sync(self._model_for(model))

    def train_batch(
        self,
        model: torch.nn.Module | None,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        loss_scale: float = 1.0,
    ) -> StepOutput:
        """Forward and backward of one batch under any strategy; returns its loss (detached).

        ``inputs``: the model's positional arguments (a tuple; anything else is the only argument), their
        first dimension the batch. ``loss_fn(outputs, targets)`` returns the batch's mean loss. Gradients are
        those of ``loss_scale`` times the loss (``1 / accumulation`` when accumulating), added to ``.grad``.
        Under a pipeline, pass the same batch on every rank of the pipeline: the first stage reads the
        inputs, the last the targets, and the loss comes back on every rank. ``outputs`` of the result are
        the model's outputs where this rank has them (under a pipeline, on the last stage only).
        """
        model = self._model_for(model)
        args = as_inputs(inputs)
        owned = self.run_training_batch(model, (args, targets), 0, given_split, loss_fn, loss_scale)
        if owned is not None:
            return owned
        with self._hooks.forward_context():
            outputs = model(*args)
            loss = scalar_loss(loss_fn(outputs, targets), "loss_fn")
        self._hooks.backward(loss * loss_scale if loss_scale != 1.0 else loss, model)
        return StepOutput(loss=loss.detach(), outputs=outputs)

    def eval_batch(
        self,
        model: torch.nn.Module | None,
        inputs: Any,
        targets: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> StepOutput:
        """Forward only (no gradients) of one batch under any strategy; the loss when ``loss_fn`` and
        ``targets`` are given. The model's train/eval mode is the caller's to set."""
        model = self._model_for(model)
        args = as_inputs(inputs)
        wanted = loss_fn if targets is not None else None
        with torch.no_grad():
            owned = self.run_evaluation_batch(model, (args, targets), 0, given_split, wanted, "validation")
            if owned is not None:
                return owned
            with self._hooks.forward_context():
                outputs = model(*args)
                loss = None if wanted is None else scalar_loss(wanted(outputs, targets), "loss_fn")
        return StepOutput(loss=loss, outputs=outputs)

    # the hooks themselves, for loops with an ordinary path of their own (the Trainer) -------------
    def check_batch_size(self, batch_size: int) -> None:
        """Let the strategy refuse a per-process batch size before the first batch."""
        self._hooks.check_batch_size(batch_size)

    def run_training_batch(
        self,
        model: torch.nn.Module,
        batch: Any,
        batch_idx: int,
        split_batch: Callable[[Any], tuple[tuple[Any, ...], Any]],
        compute_loss: Callable[[Any, Any], torch.Tensor],
        loss_scale: float = 1.0,
    ) -> StepOutput | None:
        """The strategy's own forward and backward of ``batch``, or ``None``: run the ordinary path then."""
        return self._hooks.run_training_batch(model, batch, batch_idx, split_batch, compute_loss, loss_scale)

    def run_evaluation_batch(
        self,
        model: torch.nn.Module,
        batch: Any,
        batch_idx: int,
        split_batch: Callable[[Any], tuple[tuple[Any, ...], Any]],
        compute_loss: Callable[[Any, Any], torch.Tensor] | None,
        stage: str,
    ) -> StepOutput | None:
        """The strategy's own forward-only run of ``batch``, or ``None``: call the ``*_step`` then."""
        return self._hooks.run_evaluation_batch(model, batch, batch_idx, split_batch, compute_loss, stage)
