"""Averaging gradients (or any per-parameter tensors) within a replica group and across the groups present.

One flat buffer per dtype rather than DDP's buckets: the buckets DDP rebuilds after its first step differ from
those a replica that just (re)started has, and torchft all-reduces them pairwise across groups, so a rejoining
group would exchange mismatched buffers. A flat buffer in parameter order is the same in every group at every
step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def local_gradients(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each trainable parameter's local gradient; a parameter this step left without one gets zeros, so that
    every group's buffer has the same layout."""
    grads = []
    for param in params:
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(_local(param.grad))
    return grads


@torch.no_grad()
def average(tensors: list[torch.Tensor], *, group_size: int, manager: Any) -> None:
    """Average ``tensors`` in place: over this replica group's ranks (``group_size > 1``: a plain all-reduce of
    its process group), then over the replica groups present (``manager``: torchft's fault-tolerant all-reduce,
    which divides by the groups that take part and, on a failure, reports it for the commit to refuse the step).
    ``manager=None`` averages within the group only."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        if group_size > 1:
            dist.all_reduce(flat)
            flat.div_(group_size)
        if manager is not None:
            manager.allreduce(flat).wait()
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
