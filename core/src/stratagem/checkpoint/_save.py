"""A save for any strategy, top-down: where it goes (:mod:`._publish`), the strategy's conversions, the bytes
written (:mod:`._write`), then publication, each phase ended by the ranks' agreement (:mod:`._ranks`).

Every function here runs on every rank. Local work comes first (so that a rank failing there does not leave its
peers inside a collective), then the strategy's conversions (which may be collectives), then the writes. Nothing
reaches the checkpoint's path until every rank has succeeded; a failure on any rank fails the call on all of them
with that rank's error, and the previous checkpoint there stays whole. A save with ``blocking=False`` hands its
writes to :mod:`._async` once the state is converted.
"""

from __future__ import annotations

import os
from typing import Any

from stratagem.checkpoint import _async, _publish, _write
from stratagem.checkpoint._async import PendingSave
from stratagem.checkpoint._publish import Destination
from stratagem.checkpoint._ranks import Agreement, _converted, _gather_per_rank, _local_state
from stratagem.checkpoint._state_layout import Parts, check_plain, classify, metadata
from stratagem.errors import CheckpointError


def save(
    strategy: Any,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    fmt: str,
    *,
    blocking: bool = True,
    on_published: Any = None,
) -> PendingSave | None:
    """Save on every rank. With ``blocking=False``, return once the state is copied off the training path;
    the writes go on in the background (``on_published``, on the ranks that pass it, runs after they are
    published) and :func:`~stratagem.checkpoint._async.finish` waits for them."""
    destination = _publish.destination(path)
    if fmt not in ("full", "sharded"):
        raise CheckpointError(destination.location, f"unknown format {fmt!r}; use 'full' or 'sharded'.")
    agreement = Agreement(strategy, destination.location)
    parts = classify(state)
    if fmt == "full":
        return _save_full(strategy, destination, agreement, parts, blocking, on_published)
    return _save_sharded(strategy, destination, agreement, parts, blocking, on_published)


def _save_full(
    strategy: Any,
    destination: Destination,
    agreement: Agreement,
    parts: Parts,
    blocking: bool,
    on_published: Any,
) -> PendingSave | None:
    with agreement:
        local = _local_state(parts)
        if strategy.is_global_zero:
            destination.prepare("full")
    with agreement:
        payload = _full_payload(strategy, parts, local)
    if not blocking:
        return _async.save_full(strategy, destination, parts, payload, on_published)
    with agreement:
        if strategy.is_global_zero:
            _write.full(destination, payload)
    if on_published is not None:
        on_published()
    return None


def _full_payload(strategy: Any, parts: Parts, local: dict[str, Any]) -> dict[str, Any]:
    """The whole tensors (the strategy gathers them: a collective) and every rank's per-rank values; rank 0,
    which writes them, checks them and adds the metadata."""
    payload = _converted(strategy, parts, full=True)
    payload["state"] = _gather_per_rank(strategy, local)
    if strategy.is_global_zero:
        check_plain(payload["model"], "model", whole=True)
        check_plain(payload["optimizers"], "optimizers", whole=True)
        payload["stratagem"] = metadata(strategy, "full", parts)
    return payload


def _save_sharded(
    strategy: Any,
    destination: Destination,
    agreement: Agreement,
    parts: Parts,
    blocking: bool,
    on_published: Any,
) -> PendingSave | None:
    staging = destination.staging(strategy)
    with agreement:
        local = _local_state(parts)
        if strategy.is_global_zero:
            destination.prepare("sharded", staging)
    try:
        with agreement:
            tensors = _converted(strategy, parts, full=False)
            check_plain(tensors, "sharded state")
            plain = _gather_per_rank(strategy, local)
        meta = metadata(strategy, "sharded", parts) if strategy.is_global_zero else {}
        if not blocking:
            return _async.save_sharded(
                strategy, destination, staging, parts, tensors, plain, meta, on_published
            )
        with agreement:
            _write.shards(destination, staging, tensors)
        with agreement:
            if strategy.is_global_zero:
                _write.plain_state(destination, staging, plain)
                destination.publish(staging, meta)
        if on_published is not None:
            on_published()
        return None
    except BaseException:
        if strategy.is_global_zero:
            destination.discard(staging)
        raise
