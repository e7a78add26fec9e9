"""What a strategy that runs the step itself hands back (``run_training_batch``, ``run_evaluation_batch``), and
the batch forms the loops pass it.

Most strategies leave the step to the loop: forward in ``forward_context``, then ``backward``. A pipeline
cannot: no rank holds the whole model, the inputs exist on the first stage and the loss on the last, and the
forward and backward of the micro-batches interleave inside a schedule. Such a strategy implements the step
hooks and returns a :class:`StepOutput`; the loops then skip their ordinary path.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from stratagem.errors import ConfigurationError


@attrs.frozen
class StepOutput:
    """One batch run by the strategy.

    :param loss: the batch's mean loss (over its micro-batches), detached and not scaled by ``loss_scale``,
        the same on every rank that ran the batch; ``None`` in an evaluation without a loss.
    :param outputs: the model's outputs on the ranks that hold them (a pipeline's last stage), else ``None``.
    """

    loss: torch.Tensor | None
    outputs: Any = None


def as_inputs(inputs: Any) -> tuple[Any, ...]:
    """The model's positional arguments: a tuple as given, anything else as the only argument."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def given_split(batch: tuple[tuple[Any, ...], Any]) -> tuple[tuple[Any, ...], Any]:
    """``split_batch`` for a batch that is already ``(inputs, targets)`` (``Engine.train_batch``)."""
    return batch


def scalar_loss(loss: Any, where: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise ConfigurationError(
            f"{where} returned {type(loss).__name__}{shape}; return the batch's mean loss as a scalar tensor."
        )
    return loss
