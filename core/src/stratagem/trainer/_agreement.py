"""How the ranks agree, at step boundaries, whether any of them caught a preemption signal, at a cost per step
that stays small however short the steps are.

An exchange is one four-element all-reduce (max): whether the rank caught a signal, when (negated, so that the
earliest wins), which one, and the rank's mean step time since the previous exchange. It is started at one
boundary and read at the next, so no step waits for it. Every rank decides on the reduced value alone, never on
what it caught itself, so all stop at the same boundary.

Exchanges are started every N boundaries, N computed by every rank from the same reduced value: the slowest
rank's mean step t gives ``N = max(1, floor(budget / t) - 1)``. A signal that just missed an exchange is carried
by the next one, N boundaries later, and read one boundary after that: within ``(N + 1) t <= budget`` when steps
are short, within two steps when they are longer than a third of the budget (N = 1: every boundary). Because N
comes from a reduced value and nothing else, every rank starts and reads the same exchanges at the same
boundaries whatever else blocks it (a collective of the step, a save): the exchanges cannot be mismatched.

The exchanges run on a gloo group of their own, created by every rank at the start of ``fit`` and destroyed at
its end:

- they never order against the step's collectives (ddp's bucketed all-reduce, FSDP's gathers, a pipeline's
  sends and receives, DeepSpeed's), which go through the strategy's groups;
- on an accelerator they stay on the CPU, so reading one never waits for the step's queued kernels.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from stratagem.engine import Engine

#: Seconds a signal may wait for the exchange that carries it and the boundary that reads it, when steps are
#: short: half of the second the docs promise, so that steps up to twice as slow as the last exchange measured
#: still keep the promise.
BUDGET_S = 0.5
#: One rank's side of the exchange when it caught nothing: (caught, -time, signal), reduced by max.
NOTHING = (0.0, float("-inf"), 0.0)

Reduced = tuple[float, float, float, float]


def interval(step_s: float, budget_s: float) -> int:
    """Boundaries from one exchange's start to the next one's, for steps of ``step_s`` seconds."""
    if not step_s > 0:
        return 1
    return max(1, math.floor(budget_s / step_s) - 1)


class Agreement:
    """One ``fit``'s exchanges between the ranks; built by every rank at the same point (a collective)."""

    def __init__(self, engine: Engine) -> None:
        import torch.distributed as dist

        self.engine = engine
        self.budget_s = BUDGET_S  # read here, so that a benchmark can set another for the fits it times
        self._group: Any = None
        if dist.is_available() and dist.is_initialized():
            # new_group is collective over the default group: every rank forms it here, in the same order as
            # the strategy's own groups (formed in setup, before fit), so the names agree.
            self._group = dist.new_group(backend="gloo")
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._boundary = 0
        self._due = 1  # the boundary that starts the next exchange
        # The boundary and time of the last exchange's start; before the first, fit's start: the first step
        # time then includes the set-up, which makes the first interval shorter (the safe direction).
        self._last = (0, time.perf_counter())

    def exchange(self, local: tuple[float, float, float]) -> Reduced | None:
        """At a boundary: what the exchange the previous boundary started reduced to (``None`` when it started
        none), having started this boundary's with ``local`` when one is due and no rank was signalled yet."""
        self._boundary += 1
        previous = self.settle()
        if previous is not None:
            self._due = self._last[0] + interval(previous[3], self.budget_s)
            if previous[0] > 0:
                return previous
        if self._boundary < self._due:
            return previous
        now = time.perf_counter()
        step_s = (now - self._last[1]) / (self._boundary - self._last[0])
        self._last = (self._boundary, now)
        self._start((*local, step_s))
        if self._group is not None:
            return previous
        # A strategy whose collectives are not torch.distributed's agreed at once through its all_reduce.
        reduced = self.settle()
        assert reduced is not None
        self._due = self._boundary + interval(reduced[3], self.budget_s)
        return reduced

    def final(self, local: tuple[float, float, float]) -> Reduced:
        """At the end of training, every rank at the same step: the exchange in flight, and unless it says to
        stop, one more, waited for, so that a signal caught since the last exchange started is not lost."""
        previous = self.settle()
        if previous is not None and previous[0] > 0:
            return previous
        self._start((*local, 0.0))
        reduced = self.settle()
        assert reduced is not None
        return reduced

    def settle(self) -> Reduced | None:
        """Wait for the exchange in flight and return its result (``None``: none was in flight)."""
        if self._pending is None:
            return None
        work, flag = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        signalled, earliest_negated_time, signal_number, step_s = flag.tolist()
        return signalled, earliest_negated_time, signal_number, step_s

    def _start(self, values: tuple[float, float, float, float]) -> None:
        if self._group is None:
            flag = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
            self._pending = (None, self.engine.all_reduce(flag, "max"))
            return
        import torch.distributed as dist

        flag = torch.tensor(values, dtype=torch.float64)
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
