"""How the loop calls into the user's model: batches to the device, each step through the wrapped model's call,
and the loss out of what the step returned."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from stratagem.errors import ConfigurationError


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating-point tensors in ``dtype`` (integer tensors, token ids, stay as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, (list, tuple)):
        cast = [cast_floats(item, dtype) for item in batch]
        return type(batch)(*cast) if hasattr(batch, "_fields") else type(batch)(cast)
    if isinstance(batch, dict):
        return {key: cast_floats(value, dtype) for key, value in batch.items()}
    return batch


def batch_for(batch: Any, device: torch.device, precision: str) -> Any:
    """A batch as the step receives it: on the device, and under a ``*-true`` precision with its floating-point
    tensors in the parameters' dtype (the model computes in that dtype throughout)."""
    from stratagem.strategies.precision import param_dtype

    if device.type != "cpu":
        batch = to_device(batch, device)
    dtype = param_dtype(precision)
    return batch if dtype is None else cast_floats(batch, dtype)


@contextlib.contextmanager
def redirected_forward(module: torch.nn.Module, method: str) -> Iterator[None]:
    """Make ``wrapper(*args)`` run ``module.<method>(*args)`` inside the wrapper's forward.

    A wrapper (DDP, a sharding wrapper) does its work around its own forward, and a strategy that wraps in place
    (FSDP2) hooks the module's own call; calling ``training_step`` on the module directly would skip either. The original forward is put back as soon as the step starts, so the
    step's own ``self(x)`` calls reach the real forward.
    """
    had_instance_forward = "forward" in module.__dict__
    original = module.__dict__.get("forward")

    def restore() -> None:
        if had_instance_forward:
            module.forward = original  # type: ignore[method-assign]
        else:
            module.__dict__.pop("forward", None)

    def step_as_forward(*args: Any, **kwargs: Any) -> Any:
        restore()
        return getattr(module, method)(*args, **kwargs)

    module.forward = step_as_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        restore()


def call_step(model: torch.nn.Module, module: torch.nn.Module | None, method: str, *args: Any) -> Any:
    """``module.<method>(*args)`` through the wrapped ``model``'s call."""
    # Always through the wrapped model's __call__, also when the strategy wrapped in place (FSDP2, tensor
    # parallel): their forward hooks gather the root's parameters, which calling the step directly skips.
    assert model is not None and module is not None
    with redirected_forward(module, method):
        return model(*args)


def loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise ConfigurationError(
            f"training_step returned {type(output).__name__}; return the loss tensor (or a dict with 'loss')."
        )
    return loss
