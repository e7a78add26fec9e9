"""Where a save's bytes are written: the full checkpoint file, every rank's DCP shards, and the plain state
(``state.pt``) of a sharded checkpoint.

Each goes into what the destination hands out (:mod:`stratagem.checkpoint._publish`), never under the checkpoint's
own name: a temporary beside it, a scratch file uploaded as one object, a data prefix that no manifest names yet.
The metadata (``stratagem.json``) is written by the publication itself, last. Only tensors and builtins are
written, so that loading never runs pickled code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from stratagem.checkpoint import _atomic, _checksum, _dcp
from stratagem.checkpoint._publish import Destination
from stratagem.checkpoint._ranks import _distributed, _single_process_quiet
from stratagem.checkpoint._state_layout import STATE_FILE
from stratagem.checkpoint._store import Location


def full(destination: Destination, payload: dict[str, Any]) -> None:
    """Rank 0: the full checkpoint, one ``torch.save`` file ending in its checksum's trailer, published as it is
    closed (renamed into place, or uploaded as one object, the whole file's CRC32C sent for the store to check)."""
    payload = {**payload, "stratagem": {**payload["stratagem"], "checksum": _checksum.TRAILER_KIND}}
    with _needing(payload), destination.full_file() as file:
        with open(file, "wb") as raw:
            summing = _checksum.Summing(raw)
            torch.save(payload, summing)
            tail = _checksum.trailer(summing.value, summing.length)
            raw.write(tail)
        destination.expect_crc32c(_checksum.crc_bytes(tail, summing.value))


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@contextlib.contextmanager
def _needing(state: Any) -> Iterator[None]:
    """A write that fails says how many bytes it needed (its tensors': the file is a little larger)."""
    try:
        yield
    except _atomic.WriteError as error:
        raise _atomic.WriteError(
            f"{error} This write needed about {_tensor_bytes(state)} bytes (its tensors)."
        ) from error


def shards(destination: Destination, staging: Location, tensors: dict[str, Any]) -> dict[str, str]:
    """Every rank: its shards under ``staging``, and DCP's index (``.metadata``, written by DCP's coordinator once
    every rank has written). DCP agrees inside: it raises on every rank if any rank failed. Returns on rank 0
    every file's checksum."""
    import torch.distributed.checkpoint as dcp

    writer = _dcp.writer(staging)
    try:
        with _needing(tensors):
            try:
                with _single_process_quiet():
                    dcp.save(tensors, storage_writer=writer, no_dist=not _distributed())
            except _dcp.ERRORS as error:
                raise destination.write_failure(staging, error, _dcp.describe(error)) from error
    except _atomic.WriteError as error:
        raise _atomic.WriteError(f"{error} (this rank's shards)") from error
    return writer.checksums


def start_shards(
    staging: Location, tensors: dict[str, Any], process_group: Any, stager: Any
) -> tuple[Any, Any]:
    """Every rank: its shards under ``staging`` with ``dcp.async_save``, which returns once ``stager`` (if any)
    has begun copying them and writes them from a thread; its collectives run on ``process_group``. Returns
    DCP's response and the writer, whose ``checksums`` (on rank 0) name every file once the save is done."""
    import torch.distributed.checkpoint as dcp

    writer = _dcp.writer(staging)
    with _single_process_quiet():
        response = dcp.async_save(
            tensors,
            storage_writer=writer,
            process_group=process_group,
            no_dist=not _distributed(),
            async_stager=stager,
        )
    return response, writer


def plain_state(destination: Destination, staging: Location, plain: dict[str, Any]) -> dict[str, str]:
    """Rank 0: the plain state of a sharded checkpoint (``state.pt``), once every rank's shards are written;
    returns its checksum."""
    with _needing(plain), destination.staged_file(staging, STATE_FILE) as file:
        with open(file, "wb") as raw:
            summing = _checksum.Summing(raw)
            torch.save(plain, summing)
        destination.expect_crc32c(summing.value)
    return {STATE_FILE: _checksum.hexdigest(summing.value)}


def manifest_checksums(files: dict[str, str]) -> dict[str, Any]:
    """What a sharded checkpoint's ``stratagem.json`` records of its files."""
    return {"checksums": {"algorithm": _checksum.ALGORITHM, "files": dict(sorted(files.items()))}}
