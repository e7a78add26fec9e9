"""The activations of one step as torch's memory tracker sees them, and one micro-batch through the loop's
ordinary path. (What a rank holds besides is counted by ``Strategy.memory_held``, :mod:`stratagem.strategies.memory`.)"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

ACTIVATION_KINDS = ("Activation", "Temp")


def _lean_tracker(trace: Any) -> Any:
    """Torch's ``MemTracker`` without its per-module peaks: after every operation it updates the peak of each
    module on the call stack by walking all the modules it knows, which made a step of a model of a thousand
    modules take hours. The plan reads the global peak only, which this keeps as torch computes it. It also
    records the functional collectives it sees into ``trace`` (:mod:`stratagem.planning._trace`): one dispatch
    mode for both, since each mode costs every operation of the step a Python call."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from stratagem.planning._trace import functional_collective

    class LeanTracker(MemTracker):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            result = super().__torch_dispatch__(func, types, args, kwargs)
            # NotImplemented: a DTensor's op, dispatched again as local ops, recorded then.
            if trace is not None and result is not NotImplemented:
                found = functional_collective(func, args)
                if found is not None:
                    trace.record(*found)
            return result

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            # A module called inside its own forward (the Trainer's training_step, run as the wrapper's forward,
            # calls the module again): torch's tracker takes it for the next iteration and refuses. What the
            # inner call allocates is inside the outer call's, so it is not started again.
            stats = self.memory_tracking.get(module)
            if stats is not None and not self._mod_tracker.is_bw and _ModState.POST_FW not in stats.snapshots:
                return
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                total = snapshot["Total"]
                if self._peak_mem.get(device, 0) < total:
                    self._peak_mem[device] = total
                    self._peak_mem_snap[device] = deepcopy(snapshot)

    return LeanTracker()


class ActivationMeter:
    """Torch's memory tracker (``torch.distributed._tools.mem_tracker.MemTracker``) around one forward and
    backward. :attr:`peak` is what the step allocated beyond parameters, buffers, gradients and optimizer
    state at the step's peak: activations saved for backward and the temporaries of the moment (under a
    sharded strategy, the parameters it gathers for the step among them). Works on real and on fake tensors
    alike (enter it inside the fake-tensor mode). Given a ``trace``, records the functional collectives too."""

    def __init__(self, *tracked: Any, trace: Any = None) -> None:
        self._tracker = _lean_tracker(trace)
        self._tracker.track_external(*tracked)
        self.peak = 0

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        with self._tracker:
            yield
        snapshot = self._tracker.get_tracker_snapshot("peak")
        self.peak = sum(
            int(value)
            for per_device in snapshot.values()
            for kind, value in per_device.items()
            if getattr(kind, "value", kind) in ACTIVATION_KINDS
        )


def one_step(
    step: Callable[[], torch.Tensor],
    forward_context: Callable[[], Any],
    backward: Callable[[torch.Tensor], None],
    meter: ActivationMeter | None = None,
) -> None:
    """One micro-batch through the loop's ordinary path (``Engine.train_batch``'s): ``step()`` (forward and
    loss) in the strategy's forward context, then its backward; measured by ``meter`` if given."""
    with meter.measuring() if meter is not None else contextlib.nullcontext():
        with forward_context():
            loss = step()
        backward(loss)
