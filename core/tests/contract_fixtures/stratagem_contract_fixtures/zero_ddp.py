"""A third party's strategy: DDP with the optimizer state sharded by ``ZeroRedundancyOptimizer``.

Written from the hook specs and ``docs/plugin-authors.md`` alone. The strategy wraps the user's optimizer in its
own object, and customises checkpointing through the ``save_checkpoint`` / ``load_checkpoint`` hooks, which
receive exactly the optimizers its ``setup_optimizers`` returned.

A full checkpoint needs the whole optimizer state, which no rank holds: the hooks consolidate it, hand the
base writer a plain optimizer of the same class holding it, and on load hand the base reader such an optimizer
and pass what it read back to the ZeRO optimizer, which keeps its own shard.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from stratagem import hookimpl
from stratagem.strategies import TorchDistributedStrategy


def _zero(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    cls = type(optimizer)
    accepted = inspect.signature(cls).parameters
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, **options)


def _whole(zero: ZeroRedundancyOptimizer) -> torch.optim.Optimizer:
    """A plain optimizer of the same class over the same parameters, with no state yet."""
    cls = zero.optim.__class__
    accepted = inspect.signature(cls).parameters
    options = {k: v for k, v in zero.defaults.items() if k in accepted}
    params = [p for group in zero.param_groups for p in group["params"]]
    return cls(params, **options)


class ZeroDDP(TorchDistributedStrategy):
    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return DistributedDataParallel(model)

    @hookimpl
    def setup_optimizers(self, model: torch.nn.Module, optimizers: list[Any]) -> list[Any]:
        return [_zero(optimizer) for optimizer in optimizers]

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> Any:
        return model.no_sync()

    @hookimpl
    def save_checkpoint(self, path: str, state: dict[str, Any], format: str) -> None:
        whole = {}
        for key, zero in _zeros(state).items():
            zero.consolidate_state_dict(to=0)  # collective: every rank takes part
            full = zero.state_dict() if self.is_global_zero else None
            whole[key] = _whole(zero)
            whole[key].load_state_dict(self.broadcast(full, 0))
        super().save_checkpoint(path, {**state, **whole}, format)

    @hookimpl
    def load_checkpoint(self, path: str, state: dict[str, Any], strict: bool) -> dict[str, Any]:
        zeros = _zeros(state)
        whole = {key: _whole(zero) for key, zero in zeros.items()}
        rest = super().load_checkpoint(path, {**state, **whole}, strict)
        for key, zero in zeros.items():
            zero.load_state_dict(whole[key].state_dict())  # each rank keeps its own shard
        return rest


def _zeros(state: dict[str, Any]) -> dict[str, ZeroRedundancyOptimizer]:
    return {key: value for key, value in state.items() if isinstance(value, ZeroRedundancyOptimizer)}
