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


class FlatGradients:
    """The gradients of plain (unsharded) parameters kept as views of one flat buffer per dtype, in parameter
    order, so that averaging them is one all-reduce of each buffer in place: no buffer made and no copy back
    per step. A gradient autograd made afresh (after ``zero_grad(set_to_none=True)``) is copied in once and
    replaced by its view; one a step left unset becomes its view, zeroed."""

    def __init__(self) -> None:
        self._params: list[torch.nn.Parameter] = []
        self._views: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []

    def gather(self, params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The flat buffers holding this step's gradients of ``params``, one per dtype."""
        params = [p for p in params if p.requires_grad]
        if len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params)):
            self._layout(params)
        with torch.no_grad():
            for param, view in zip(self._params, self._views):
                grad = param.grad
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
                    view.copy_(grad)
                else:
                    continue
                param.grad = view
        return self._buffers

    def _layout(self, params: list[torch.nn.Parameter]) -> None:
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        views: dict[int, torch.Tensor] = {}
        self._buffers = []
        for same in by_dtype.values():
            flat = torch.zeros(sum(p.numel() for p in same), dtype=same[0].dtype, device=same[0].device)
            offset = 0
            for param in same:
                views[id(param)] = flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
            self._buffers.append(flat)
        self._params = params
        self._views = [views[id(p)] for p in params]


def across_groups(tensor: torch.Tensor, manager: Any, process_group: Any) -> None:
    """Average ``tensor`` in place over the replica groups of this step's quorum: what torchft's
    ``Manager.allreduce(tensor).wait()`` does for an average, called straight on the Manager's process group.

    Without the Manager's future chain (a callback, a timeout registered with torchft's timer thread, a wrapped
    future per call), which cost about a millisecond of CPU a step on two cores. A group that heals this step
    contributes zeros; an error is reported to the Manager, whose commit then refuses the step; the process
    group's own timeout (the strategy's ``timeout``) bounds the wait, as the Manager's did."""
    if manager.errored() is not None:
        return  # an earlier failure in this step: the step is refused, nothing to exchange
    participants = manager.num_participants()  # waits for the quorum
    if not manager.is_participating():
        tensor.zero_()
    try:
        process_group.allreduce([tensor], dist.ReduceOp.SUM).wait()
    except Exception as error:  # any failure of a peer refuses the step, as in torchft
        manager.report_error(error)
        return
    tensor.div_(participants)


@torch.no_grad()
def average_flat(
    buffers: list[torch.Tensor], *, group_size: int, manager: Any = None, process_group: Any = None
) -> None:
    """Average flat buffers in place: over this replica group's ranks (``group_size > 1``: a plain all-reduce of
    its process group), then over the replica groups present (``manager``: :func:`across_groups` on
    ``process_group``)."""
    for flat in buffers:
        if group_size > 1:
            dist.all_reduce(flat)
            flat.div_(group_size)
        if manager is not None:
            across_groups(flat, manager, process_group)


@torch.no_grad()
def average(
    tensors: list[torch.Tensor], *, group_size: int, manager: Any = None, process_group: Any = None
) -> None:
    """Average ``tensors`` in place, through one flat copy per dtype (:func:`average_flat`); for tensors that
    cannot be views of a flat buffer (a sharded parameter's local gradient). ``manager=None`` averages within
    the group only."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        average_flat([flat], group_size=group_size, manager=manager, process_group=process_group)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
