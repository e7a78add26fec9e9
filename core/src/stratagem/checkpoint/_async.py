"""Asynchronous saves (``blocking=False``): what a step changes is copied in the background behind a
:class:`StepFence`, the writes go on in a thread (DCP's ``async_save`` for sharded checkpoints), and
:func:`finish` waits for them on every rank and raises their failure everywhere."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _atomic, _dcp, _write
from stratagem.checkpoint._publish import Destination
from stratagem.checkpoint._ranks import _agree, _attempt, _describe, _distributed
from stratagem.checkpoint._state_layout import Parts
from stratagem.checkpoint._store import Location
from stratagem.errors import CheckpointError


class StepFence:
    """Holds every optimizer's ``step`` until the background copy of what a step would change is taken.

    A background save must hold the state of the step it was taken at, yet copying all of it before
    ``save`` returns stalls training for the whole copy. Parameters and optimizer state change only in an
    optimizer step, so they are copied in the background while the next forward and backward run, and a
    global step pre-hook makes any optimizer's step wait for that copy. What a forward may change (buffers,
    such as batch-norm statistics) and the plain state are copied before ``save`` returns.
    """

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._staged = threading.Event()
        self._handle = register_optimizer_step_pre_hook(self._hold)

    def _hold(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._staged.wait()

    def release(self) -> None:
        """The copy is taken (or failed): steps go on. Any thread."""
        self._staged.set()

    def remove(self) -> None:
        """Training thread only: the hook table is not to be changed while a step iterates over it."""
        self._staged.wait()
        self._handle.remove()


def _storage(tensor: torch.Tensor) -> int:
    """The address of the memory ``tensor`` lives in (a DTensor's: its local shard's); 0 if it has none."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # meta, sparse: nothing to share
        return 0


def _step_storages(parts: Parts) -> set[int]:
    """The memory that only an optimizer step changes: the optimizers' parameters and their state."""
    addresses: set[int] = set()
    for optimizer in parts.optimizers.values():
        for group in getattr(optimizer, "param_groups", ()):
            addresses.update(_storage(p) for p in group.get("params", ()) if isinstance(p, torch.Tensor))
        for per_param in getattr(optimizer, "state", {}).values():
            if isinstance(per_param, dict):
                addresses.update(_storage(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    addresses.discard(0)
    return addresses


class PendingSave:
    """A save whose writes go on in the background (``blocking=False``); :func:`finish` ends it on every rank."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.fence: StepFence | None = None
        self._thread: threading.Thread | None = None
        self._future: Any = None

    def start(self, work: Any) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as error:  # kept, and raised on every rank by finish()
                self.error = error

        self._thread = threading.Thread(target=run, name="stratagem-checkpoint", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """True once this rank's part of the save has finished (written, or failed)."""
        if self._thread is not None and self._thread.is_alive():
            return False
        return self._future is None or self._future.done()

    def wait(self) -> BaseException | None:
        if self.fence is not None:
            self.fence.remove()
            self.fence = None
        if self._future is not None:
            try:
                self._future.result()
            except _dcp.ERRORS as error:
                self.error = self.error or error
        if self._thread is not None:
            self._thread.join()
        return self.error


def finish(strategy: Any, pending: PendingSave) -> None:
    """Wait for a background save on every rank; raise its failure (any rank's) on all of them, naming the path.

    A collective: every rank calls it at the same point (the next save, a load, the end of ``fit``)."""
    error = pending.wait()
    if error is not None and not isinstance(error, CheckpointError):
        if isinstance(error, _atomic.WriteError):
            error = CheckpointError(pending.path, f"the background save failed: {error}")
        else:
            error = CheckpointError(pending.path, f"the background save failed: {_describe(error)}")
    _agree(strategy, pending.path, error)


def _cpu_copy(value: Any, select: Any = None) -> Any:
    """A copy of ``value`` that training cannot change: tensors copied to CPU (those ``select`` accepts, if
    given; the others are kept as they are), containers rebuilt."""
    if isinstance(value, torch.Tensor):
        if select is not None and not select(value):
            return value
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v, select) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu_copy(v, select) for v in value]
    if isinstance(value, tuple):
        return tuple(_cpu_copy(v, select) for v in value)
    return value


def _async_group(strategy: Any) -> Any:
    """A gloo process group of its own for DCP's background collectives (training keeps the default one)."""
    if not _distributed():
        return None
    group = getattr(strategy, "_stratagem_checkpoint_group", None)
    if group is None:
        import torch.distributed as dist

        group = dist.new_group(backend="gloo")
        strategy._stratagem_checkpoint_group = group
    return group


def _stager(strategy: Any) -> Any:
    """DCP's stager for this strategy's background saves, kept from one save to the next: it copies into the
    CPU memory it allocated for the previous save (fresh memory for each save costs its page faults on the
    training's cores). Released by :func:`release_async_resources`."""
    stager = getattr(strategy, "_stratagem_stager", None)
    if stager is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        strategy._stratagem_stager = stager
    return stager


def release_async_resources(strategy: Any) -> None:
    """Free the CPU memory the stager kept for asynchronous saves (at teardown, after the last save)."""
    stager = getattr(strategy, "_stratagem_stager", None)
    if stager is not None:
        strategy._stratagem_stager = None
        stager.close()


def save_full(
    strategy: Any, destination: Destination, parts: Parts, payload: dict[str, Any], on_published: Any
) -> PendingSave:
    """Rank 0 writes the gathered ``payload`` from a thread: what a step changes is copied there, behind a
    :class:`StepFence`; the rest before returning. A failure (out of memory) is raised by :func:`finish`,
    everywhere."""
    pending = PendingSave(destination.location)
    if not strategy.is_global_zero:
        return pending
    stepped = _step_storages(parts)
    staged, pending.error = _attempt(_cpu_copy, payload, lambda t: _storage(t) not in stepped)
    del payload
    if pending.error is not None:
        return pending
    fence = pending.fence = StepFence() if stepped else None

    def write_in_background() -> None:
        try:
            copy = _cpu_copy(staged, lambda t: _storage(t) in stepped) if stepped else staged
        finally:
            if fence is not None:
                fence.release()
        _write.full(destination, copy)
        if on_published is not None:
            on_published()

    pending.start(write_in_background)
    return pending


def save_sharded(
    strategy: Any,
    destination: Destination,
    staging: Location,
    parts: Parts,
    tensors: dict[str, Any],
    plain: dict[str, Any],
    meta: dict[str, Any],
    on_published: Any,
) -> PendingSave:
    """``dcp.async_save`` writes the shards in a thread (collectives on a group of their own) from a CPU copy;
    rank 0 publishes once its future says every rank has written. The shards a step changes are copied by DCP's
    stager in a thread of its own, behind a :class:`StepFence`; the rest before returning."""
    pending = PendingSave(destination.location)
    stepped = _step_storages(parts)
    plain = _cpu_copy(plain)
    stager = None
    if stepped:
        tensors = _cpu_copy(tensors, lambda t: _storage(t) not in stepped)
        stager = _stager(strategy)
    try:
        response = _write.start_shards(staging, tensors, _async_group(strategy), stager)
    except _dcp.ERRORS as error:
        future, failed = None, error
    else:
        failed = None
        future = response
        if stager is not None:
            fence = pending.fence = StepFence()
            response.staging_completion.add_done_callback(lambda _: fence.release())
            future = response.upload_completion
    if not strategy.is_global_zero:
        pending._future = future
        pending.error = failed
        return pending

    def publish_in_background() -> None:
        try:
            if failed is not None:
                raise failed
            try:
                future.result()
            except _dcp.ERRORS as error:
                raise _atomic.WriteError(_dcp.describe(error)) from error
            _write.plain_state(destination, staging, plain)
            destination.publish(staging, meta)
        except BaseException:
            destination.discard(staging)
            raise
        if on_published is not None:
            on_published()

    pending.start(publish_in_background)
    return pending
