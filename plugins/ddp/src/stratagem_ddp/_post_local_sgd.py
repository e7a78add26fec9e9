"""Post-local SGD: local steps after a warm-up, with the replicas averaged every few optimizer steps."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    # Imported where used: torch.distributed.optim pulls in FSDP and DTensor, about a second per worker.
    from torch.distributed.optim import PostLocalSGDOptimizer

#: Where a checkpoint keeps the averager's step, next to the optimizer's state.
AVERAGER_STEP_KEY = "post_local_sgd_averager_step"


def with_model_averaging(optimizer: Any, period: int | None, state: Any) -> PostLocalSGDOptimizer:
    """``optimizer`` wrapped so that each step is followed by the periodic average of the parameters."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

    if isinstance(optimizer, (PostLocalSGDOptimizer, ZeroRedundancyOptimizer)):
        raise ConfigurationError(
            f"model_averaging_period={period}: post-local SGD averages plain optimizers; got a "
            f"{type(optimizer).__name__}, which distributes its own steps. Pass the underlying optimizer."
        )
    # The averaging waits as long as the hook all-reduces gradients, so both switch over at the same step.
    averager = PeriodicModelAverager(period=period, warmup_steps=state.start_localSGD_iter)
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)


def unwrap(optimizer: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The plain optimizer inside a post-local SGD one, and its averager (or ``None``)."""
    optim_module = sys.modules.get("torch.distributed.optim")
    if optim_module is not None and isinstance(optimizer, optim_module.PostLocalSGDOptimizer):
        return optimizer.optim, optimizer.averager
    return optimizer, None


def default_subgroup_on_cpu(state: Any, device: torch.device, local_world_size: int) -> None:
    """Give a CPU run the subgroup torch would pick on GPUs: the processes of one node.

    torch's default (``dist.new_subgroups()``) sizes groups by the CUDA device count, which is 0 on a CPU
    machine and fails in the middle of a backward pass.
    """
    needs_subgroup = getattr(state, "post_local_gradient_allreduce", True)
    if device.type != "cpu" or state.subgroup is not None or not needs_subgroup:
        return
    state.subgroup, _ = dist.new_subgroups(group_size=local_world_size)
