"""What a simulated rank sends: every collective of a phase, and the bytes each rank puts on the wire for it.

Collectives reach the trace two ways. Those issued through a process group (``torch.distributed.all_reduce``,
FSDP2's all-gathers and reduce-scatters, ``DistributedDataParallel``'s bucket all-reduces from C++) call the
simulated group, which records them. Functional collectives (``torch.distributed._functional_collectives``,
which DTensor and tensor parallelism use) never reach a group under fake tensors, where their kernels only
compute output shapes: the step's dispatch mode (:class:`stratagem.planning._count.ActivationMeter`) records
those, with :func:`functional_collective`.

Bytes sent per rank are those of the bandwidth-optimal ring algorithms, the total on the wire divided among
the ``n`` ranks of the group: an all-reduce of ``S`` bytes sends ``2 (n - 1) / n * S`` from each rank (a
reduce-scatter, then an all-gather); an all-gather whose output is ``S`` bytes, and a reduce-scatter whose input
is ``S`` bytes, send ``(n - 1) / n * S``; so do a broadcast and an all-to-all of ``S``; a send sends ``S``. A
group of one rank sends nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import attrs
import torch

_current: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("stratagem_plan_trace", default=None)


def current_trace() -> Trace | None:
    return _current.get()


def sent_per_rank(op: str, group_size: int, payload: int) -> float:
    """Bytes one rank sends for ``op`` on a group of ``group_size`` ranks (the module docstring's rules)."""
    if group_size <= 1:
        return 0.0
    if op == "send":
        return float(payload)
    share = (group_size - 1) / group_size * payload
    return 2 * share if op == "all_reduce" else share


@attrs.define
class Collective:
    op: str
    group_size: int
    payload: int
    phase: str

    @property
    def sent(self) -> float:
        return sent_per_rank(self.op, self.group_size, self.payload)


@attrs.define
class Trace:
    """The collectives of one simulated rank, each tagged with the phase it ran in (``setup``, ``step``)."""

    collectives: list[Collective] = attrs.field(factory=list)
    phase: str = "setup"

    def record(self, op: str, group_size: int, payload: int) -> None:
        self.collectives.append(Collective(op, group_size, payload, self.phase))

    def sent(self, phase: str = "step") -> int:
        """Bytes this rank sends in ``phase``."""
        return round(sum(c.sent for c in self.collectives if c.phase == phase))

    def summary(self, phase: str = "step") -> dict[str, dict[str, int]]:
        """Per operation: how many ran and the bytes this rank sent for them."""
        out: dict[str, dict[str, int]] = {}
        for c in self.collectives:
            if c.phase == phase:
                entry = out.setdefault(c.op, {"count": 0, "bytes": 0})
                entry["count"] += 1
                entry["bytes"] += round(c.sent)
        return out

    @contextlib.contextmanager
    def active(self) -> Iterator[Trace]:
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before


def _group_size(name: Any) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    return sum(_nbytes(t) for t in tensor)


def functional_collective(func: Any, args: tuple[Any, ...]) -> tuple[str, int, int] | None:
    """``(op, group size, payload)`` for a functional collective, ``None`` for anything else. Argument
    positions are those of ``torch.ops._c10d_functional`` in torch 2.13."""
    namespace = func.namespace
    if namespace not in ("_c10d_functional", "_c10d_functional_autograd"):
        return None
    name = func._opname
    if name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"):
        return "all_reduce", _group_size(args[2]), _nbytes(args[0])
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
        return "all_gather", int(args[1]), _nbytes(args[0]) * int(args[1])
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"):
        return "reduce_scatter", int(args[2]), _nbytes(args[0])
    if name in ("all_to_all_single",):
        return "all_to_all", _group_size(args[3]), _nbytes(args[0])
    if name in ("broadcast", "broadcast_"):
        return "broadcast", _group_size(args[2]), _nbytes(args[0])
    return None
