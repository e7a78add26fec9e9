"""A ``stratagem.Module`` as the plan sees it (:class:`stratagem.planning.Workload`): for ``strategy="auto"``,
the module given to ``fit`` copied onto the meta device and stepped with the first batch of its training loader;
for ``stratagem plan --model package.module:Class``, the loss computed as the Trainer computes it."""

from __future__ import annotations

import copy
from typing import Any

import torch

from stratagem.errors import ConfigurationError


def module_step(model: Any, wrapped: Any, batch: Any) -> Any:
    """The loss as the Trainer computes it: ``split_batch`` and ``compute_loss`` for a module that defines its
    loss, else ``training_step`` run through the wrapper's call."""
    from stratagem.trainer._model_calls import redirected_forward
    from stratagem.trainer.module import Module, defines_loss

    if defines_loss(model):
        inputs, targets = model.split_batch(batch)
        return model.compute_loss(wrapped(*inputs), targets)
    if isinstance(model, Module) and type(model).overrides("training_step"):
        with redirected_forward(model, "training_step"):
            out = wrapped(batch, 0)
        return out["loss"] if isinstance(out, dict) else out
    raise ConfigurationError(
        f"{type(model).__name__}: the plan steps a model through its loss: define compute_loss (a "
        "stratagem.Module) or training_step."
    )


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device: their values are never copied
    (the model may be as large as the host allows), everything else is, by ``copy.deepcopy``."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, torch.nn.Parameter):
            empty = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = empty
    return copy.deepcopy(model, memo)


def fit_workload(model: Any, loader: Any) -> Any:
    """The workload ``strategy="auto"`` plans: ``model`` as ``fit`` received it, built again for each strategy
    (a meta copy, in the dtype the strategy's init context sets; ``configure_model`` run on the copy when it has
    not run on ``model``), stepped on the loader's first batch through :func:`module_step`."""
    from stratagem.planning import Workload

    batch = next(iter(loader))

    def build() -> torch.nn.Module:
        clone = _meta_copy(model)
        dtype = torch.get_default_dtype()
        if dtype != torch.float32:  # a *-true precision: parameters in its dtype, as init_module makes them
            clone.to(dtype)
        if not model.__dict__.get("_stratagem_configured", False):
            clone.configure_model()
        return clone

    return Workload(name=type(model).__name__, build=build, batch=lambda *_: batch, step=module_step)
