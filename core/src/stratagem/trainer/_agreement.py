"""How the ranks agree, at each step boundary, whether any of them caught a preemption signal, without making
every step wait for the answer.

Each boundary starts one three-element all-reduce (max) and reads the one the previous boundary started. Every
rank decides on that reduced value alone, never on what it caught itself, so all stop at the same boundary: the
one after the boundary at which the first signalled rank's exchange began. The exchange runs on a gloo group of
its own, created by every rank at the start of ``fit`` and destroyed at its end:

- it never orders against the step's collectives (ddp's bucketed all-reduce, FSDP's gathers, a pipeline's
  sends and receives, DeepSpeed's), which go through the strategy's groups;
- on an accelerator it stays on the CPU, so reading it never waits for the step's queued kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from stratagem.engine import Engine

#: One rank's side of the exchange when it caught nothing: (caught, -time, signal) reduced by max.
NOTHING = (0.0, float("-inf"), 0.0)


class Agreement:
    """One ``fit``'s exchanges between the ranks; built by every rank at the same point (a collective)."""

    def __init__(self, engine: Engine) -> None:
        import torch.distributed as dist

        self.engine = engine
        self._group: Any = None
        if dist.is_available() and dist.is_initialized():
            # new_group is collective over the default group: every rank forms it here, in the same order as
            # the strategy's own groups (formed in setup, before fit), so the names agree.
            self._group = dist.new_group(backend="gloo")
        self._pending: tuple[Any, torch.Tensor] | None = None

    def exchange(self, local: tuple[float, float, float]) -> tuple[float, float, float] | None:
        """At a boundary: what the previous boundary's exchange reduced to (``None`` at the first), having
        started this boundary's with ``local`` unless the previous one already says a rank was signalled."""
        if self._group is None:
            # A strategy whose collectives are not torch.distributed's: agree at once through its all_reduce.
            flag = torch.tensor(local, dtype=torch.float64, device=self.engine.device)
            return _triple(self.engine.all_reduce(flag, "max"))
        previous = self.settle()
        if previous is None or previous[0] == 0:
            self._start(local)
        return previous

    def settle(self) -> tuple[float, float, float] | None:
        """Wait for the exchange in flight and return its result (``None``: none was in flight)."""
        if self._pending is None:
            return None
        work, flag = self._pending
        self._pending = None
        work.wait()
        return _triple(flag)

    def _start(self, local: tuple[float, float, float]) -> None:
        import torch.distributed as dist

        flag = torch.tensor(local, dtype=torch.float64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)

    def close(self) -> None:
        """Destroy the group once nothing is in flight. With an exchange still in flight (``fit`` raised
        between two boundaries: a peer may be gone), leave the group to the strategy's teardown, which destroys
        every group, rather than wait here on a peer that may never answer."""
        import torch.distributed as dist

        group, self._group = self._group, None
        pending, self._pending = self._pending, None
        if group is None or pending is not None or not dist.is_initialized():
            return
        dist.destroy_process_group(group)


def _triple(flag: torch.Tensor) -> tuple[float, float, float]:
    signalled, earliest_negated_time, signal_number = flag.tolist()
    return signalled, earliest_negated_time, signal_number
