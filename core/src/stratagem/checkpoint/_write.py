"""Where a save's bytes are written: the full checkpoint file, every rank's DCP shards, and the plain state
(``state.pt``) of a sharded checkpoint.

Each goes into what the destination hands out (:mod:`stratagem.checkpoint._publish`), never under the checkpoint's
own name: a temporary beside it, a scratch file uploaded as one object, a data prefix that no manifest names yet.
The metadata (``stratagem.json``) is written by the publication itself, last. Only tensors and builtins are
written, so that loading never runs pickled code.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.checkpoint import _dcp
from stratagem.checkpoint._publish import Destination
from stratagem.checkpoint._ranks import _distributed, _single_process_quiet
from stratagem.checkpoint._state_layout import STATE_FILE
from stratagem.checkpoint._store import Location


def full(destination: Destination, payload: dict[str, Any]) -> None:
    """Rank 0: the full checkpoint, one ``torch.save`` file, published as it is closed (renamed into place, or
    uploaded as one object)."""
    with destination.full_file() as file:
        torch.save(payload, file)


def shards(destination: Destination, staging: Location, tensors: dict[str, Any]) -> None:
    """Every rank: its shards under ``staging``, and DCP's index (``.metadata``, written by DCP's coordinator once
    every rank has written). DCP agrees inside: it raises on every rank if any rank failed."""
    import torch.distributed.checkpoint as dcp

    try:
        with _single_process_quiet():
            dcp.save(tensors, storage_writer=_dcp.writer(staging), no_dist=not _distributed())
    except _dcp.ERRORS as error:
        raise destination.write_failure(staging, error, _dcp.describe(error)) from error


def start_shards(staging: Location, tensors: dict[str, Any], process_group: Any, stager: Any) -> Any:
    """Every rank: its shards under ``staging`` with ``dcp.async_save``, which returns once ``stager`` (if any)
    has begun copying them and writes them from a thread; its collectives run on ``process_group``."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        return dcp.async_save(
            tensors,
            storage_writer=_dcp.writer(staging),
            process_group=process_group,
            no_dist=not _distributed(),
            async_stager=stager,
        )


def plain_state(destination: Destination, staging: Location, plain: dict[str, Any]) -> None:
    """Rank 0: the plain state of a sharded checkpoint (``state.pt``), once every rank's shards are written."""
    with destination.staged_file(staging, STATE_FILE) as file:
        torch.save(plain, file)
