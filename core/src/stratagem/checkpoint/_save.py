"""Saving a checkpoint for any strategy, through the strategy's state-dict conversions.

Every function here runs on every rank. Each save runs in phases separated by an agreement between the ranks:
local work first (so that a rank failing there does not leave its peers inside a collective), then the
strategy's conversions (which may be collectives), then the writes. Nothing reaches the target path until
every rank has succeeded; a failure on any rank fails the call on all of them with that rank's error, and the
previous checkpoint under the target path stays whole.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from stratagem.checkpoint import _atomic, _dcp, _store
from stratagem.checkpoint._async import (
    PendingSave,
    StepFence,
    _cpu_copy,
    _save_sharded_in_background,
    _step_storages,
    _storage,
)
from stratagem.checkpoint._publish import _prepare_target, _publish_sharded, write_full
from stratagem.checkpoint._ranks import (
    _agree,
    _attempt,
    _converted,
    _distributed,
    _gather_per_rank,
    _local_state,
    _single_process_quiet,
)
from stratagem.checkpoint._state_layout import (
    Parts,
    check_plain,
    classify,
    metadata,
)
from stratagem.errors import CheckpointError


def save(
    strategy: Any,
    path: str | Path,
    state: dict[str, Any],
    fmt: str,
    *,
    blocking: bool = True,
    on_published: Any = None,
) -> PendingSave | None:
    """Save on every rank. With ``blocking=False``, return once the state is copied off the training path;
    the writes go on in the background (``on_published``, on the ranks that pass it, runs after they are
    published) and :func:`finish` waits for them."""
    target = _store.location(path)
    if fmt not in ("full", "sharded"):
        raise CheckpointError(target, f"unknown format {fmt!r}; use 'full' or 'sharded'.")
    parts = classify(state)
    if fmt == "full":
        return _save_full(strategy, target, parts, blocking, on_published)
    return _save_sharded(strategy, target, parts, blocking, on_published)


def _save_full(
    strategy: Any, target: Path | str, parts: Parts, blocking: bool = True, on_published: Any = None
) -> PendingSave | None:
    local, error = _attempt(_local_state, parts)
    if error is None and strategy.is_global_zero:
        _, error = _attempt(_prepare_target, target, "full")
    _agree(strategy, target, error)

    def convert() -> dict[str, Any]:
        payload = _converted(strategy, parts, full=True)
        payload["state"] = _gather_per_rank(strategy, local)
        if strategy.is_global_zero:
            check_plain(payload["model"], "model", whole=True)
            check_plain(payload["optimizers"], "optimizers", whole=True)
            payload["stratagem"] = metadata(strategy, "full", parts)
        return payload

    payload, error = _attempt(convert)
    _agree(strategy, target, error)

    if not blocking:
        pending = PendingSave(target)
        if strategy.is_global_zero:
            # What a step changes is copied in the background, behind a StepFence; the rest now. A failure
            # (out of memory) is raised by finish(), everywhere.
            stepped = _step_storages(parts)
            staged, pending.error = _attempt(_cpu_copy, payload, lambda t: _storage(t) not in stepped)
            del payload
            fence = pending.fence = StepFence() if pending.error is None and stepped else None

            def write_in_background() -> None:
                try:
                    copy = _cpu_copy(staged, lambda t: _storage(t) in stepped) if stepped else staged
                finally:
                    if fence is not None:
                        fence.release()
                write_full(target, copy)
                if on_published is not None:
                    on_published()

            if pending.error is None:
                pending.start(write_in_background)
        return pending

    def write() -> None:
        write_full(target, payload)

    if strategy.is_global_zero:
        _, error = _attempt(write)
    _agree(strategy, target, error)
    if on_published is not None:
        on_published()
    return None


def _save_sharded(
    strategy: Any, target: Path | str, parts: Parts, blocking: bool = True, on_published: Any = None
) -> PendingSave | None:
    import torch.distributed.checkpoint as dcp

    remote = isinstance(target, str)
    if remote:
        data_name = strategy.broadcast(_store.new_data_prefix(), 0)
        tmp: Path | str = _store.join(target, data_name)
    else:
        tmp = Path(strategy.broadcast(str(_atomic.temporary_sibling(target)), 0))
    local, error = _attempt(_local_state, parts)
    if error is None and strategy.is_global_zero:

        def make_directory() -> None:
            _prepare_target(target, "sharded")
            if isinstance(tmp, Path):
                tmp.mkdir(parents=True)

        _, error = _attempt(make_directory)
    _agree(strategy, target, error)
    try:
        tensors, error = _attempt(_converted, strategy, parts, False)
        if error is None:
            _, error = _attempt(check_plain, tensors, "sharded state")
        if error is None:
            plain, error = _attempt(_gather_per_rank, strategy, local)
        _agree(strategy, target, error)

        def write_shards() -> None:
            # DCP runs its own agreement inside save and raises on every rank if any rank failed.
            try:
                with _single_process_quiet():
                    dcp.save(tensors, storage_writer=_dcp.writer(tmp), no_dist=not _distributed())
            except _dcp.ERRORS as error:
                if isinstance(tmp, str):
                    raise _atomic.WriteError(_store.describe_error(tmp, error)) from error
                raise _atomic.WriteError(
                    _atomic.explain_write_failure(tmp, error, _dcp.describe(error))
                ) from error

        meta = metadata(strategy, "sharded", parts) if strategy.is_global_zero else {}
        if not blocking:
            return _save_sharded_in_background(
                strategy, target, tmp, tensors, plain, meta, on_published, _step_storages(parts)
            )

        _, error = _attempt(write_shards)
        _agree(strategy, target, error)

        if strategy.is_global_zero:
            _, error = _attempt(_publish_sharded, target, tmp, plain, meta)
        _agree(strategy, target, error)
        if on_published is not None:
            on_published()
        return None
    except BaseException:
        if strategy.is_global_zero:
            if isinstance(tmp, str):
                with contextlib.suppress(Exception):
                    _store.remove_tree(tmp)
            else:
                _atomic.remove(tmp)
        raise
