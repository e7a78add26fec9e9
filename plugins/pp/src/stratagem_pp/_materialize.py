"""Materialising stages built on the meta device, with the values one process would give the whole model.

One process initialises a meta model by running ``reset_parameters`` on each module in ``named_modules``
order from one random stream. A stage holds only some modules, so resetting just those would draw different
numbers. Here every module of the whole model is visited in that order: a module this rank holds is reset in
place (each rank keeps its shard when it is sharded, as stratagem-fsdp does), and a module another stage holds
is reset on a throw-away copy of its own tensors, only to advance the stream by what it draws. The values
then equal a one-process build from the same random state, at any pipeline degree.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.errors import ConfigurationError
from stratagem.strategies.wrapping import initializing
from stratagem_fsdp import _init
from stratagem_pp._stage import Skipped, ancestors


def record(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules with tensors of their own, in the order one process would initialise them (taken before
    the model is split: afterwards the modules other stages own are gone from it)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    ]


def _local(holder: torch.nn.Module, name: str) -> torch.nn.Module | None:
    module = holder
    for part in name.split(".") if name else []:
        module = module._modules.get(part)  # type: ignore[assignment]
        if module is None or isinstance(module, Skipped):
            return None
    return module


def materialize(
    order: list[tuple[str, torch.nn.Module]],
    holder: torch.nn.Module,
    views: list[torch.nn.Module],
    owned: list[str],
    device: torch.device,
    state: dict[str, torch.Tensor],
) -> None:
    """Allocate and initialise this rank's part of a meta model (see the module docstring)."""
    # The views are the sharding roots: allocating through them keeps FSDP's record of its shards in step.
    for view in views:
        view.to_empty(device=device)
    # Modules on the way to the stages are copies in the views: allocate the holder's, then share them.
    for name in sorted(ancestors(owned)):
        module = holder.get_submodule(name)
        module.to_empty(device=device, recurse=False)
    missing = []
    with torch.no_grad(), _init.using_random_state(state, device):
        # Under init_weights the values come from a checkpoint next: allocate only, draw nothing.
        order = order if initializing() else []
        for name, original in order:
            if not callable(getattr(original, "reset_parameters", None)):
                missing.append(name or type(original).__name__)
                continue
            here = _local(holder, name)
            if here is not None:
                _init.reset_full_then_keep_shard(here)
            else:
                # Another stage's module: draw what it would draw, then drop the values.
                original.to_empty(device=device, recurse=False)
                original.reset_parameters()  # type: ignore[operator]
                original.to_empty(device="meta", recurse=False)
    if missing:
        raise ConfigurationError(
            f"Modules {missing} were built on the meta device (empty_init=True) but have no reset_parameters() "
            "to initialise them. Add reset_parameters(), or build them with empty_init=False."
        )
    # The views' copies of the modules on the way share the holder's buffers again.
    for view in views:
        for name in ancestors(owned):
            copy = _local(view, name)
            if copy is not None:
                copy._buffers.update(holder.get_submodule(name)._buffers)


def state_for(strategy: Any) -> dict[str, torch.Tensor]:
    return strategy._init_random_state or strategy.broadcast(_init.random_state(strategy.device), 0)
