"""Rank 0's part of a save, once the data is ready: preparing the target (refusing one of the other kind,
finishing an interrupted swap), writing a full checkpoint, and publishing a sharded one (a renamed directory; on
an object store, the manifest written last)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _atomic, _store
from stratagem.checkpoint._state_layout import (
    METADATA_FILE,
    STATE_FILE,
)
from stratagem.errors import CheckpointError


def _prepare_target(target: Path | str, fmt: str) -> None:
    """Rank 0, before writing: refuse a target of the other kind, finish an interrupted swap, clean up."""
    if isinstance(target, str):
        _prepare_remote_target(target, fmt)
        return
    if fmt == "full" and target.is_dir():
        raise CheckpointError(target, "is a directory; a full checkpoint is one file. Choose another path.")
    if fmt == "sharded" and target.is_file():
        raise CheckpointError(target, "is a file; a sharded checkpoint is a directory. Choose another path.")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(
                    target, f"cannot be created: {parent} is a file, not a directory. Choose another path."
                )
            break
    _atomic.recover(target)
    _atomic.remove_stale_temporaries(target)


def _prepare_remote_target(target: str, fmt: str) -> None:
    try:
        _store.check_bucket(target)
        if fmt == "full" and _store.exists(_store.join(target, METADATA_FILE)):
            raise CheckpointError(
                target, "holds a sharded checkpoint; a full checkpoint is one object. Choose another URL."
            )
        if fmt == "sharded" and _store.is_file(target):
            raise CheckpointError(
                target,
                "is an object (a full checkpoint); a sharded checkpoint is a prefix. Choose another URL.",
            )
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(target, _store.describe_error(target, error)) from error


def write_full(target: Path | str, payload: dict[str, Any]) -> None:
    """Rank 0: the full checkpoint file, atomically (a renamed temporary; on a store, one upload)."""
    if isinstance(target, str):
        try:
            with _store.upload(target) as tmp:
                torch.save(payload, tmp)
        except Exception as error:
            raise _atomic.WriteError(_store.describe_error(target, error)) from error
        return
    with _atomic.atomic_file(target) as tmp:
        torch.save(payload, tmp)


def _publish_sharded(
    target: Path | str, tmp: Path | str, plain: dict[str, Any], meta: dict[str, Any]
) -> None:
    """Rank 0, once every rank's shards are written: the plain state and metadata, then publication."""
    if isinstance(tmp, str):
        publish_sharded_remote(target, _store.name_of(tmp), plain, meta)
        return
    assert isinstance(target, Path)
    try:
        torch.save(plain, tmp / STATE_FILE)
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2))
    except Exception as error:
        raise _atomic.WriteError(_atomic.explain_write_failure(tmp, error)) from error
    _atomic.publish_directory(tmp, target)


def publish_sharded_remote(target: Any, data_name: str, plain: dict[str, Any], meta: dict[str, Any]) -> None:
    """Rank 0, once every rank's shards and DCP's index are written under ``target/data_name``: the plain
    state, then the manifest (the checkpoint exists from that single PUT on), then old data is deleted."""
    data = _store.join(target, data_name)
    try:
        with _store.upload(_store.join(data, STATE_FILE)) as file:
            torch.save(plain, file)
        manifest = {**meta, "data": data_name}
        _store.write_bytes(_store.join(target, METADATA_FILE), json.dumps(manifest, indent=2).encode())
    except Exception as error:
        raise _atomic.WriteError(_store.describe_error(target, error)) from error
    _remove_unpublished_data(target, data_name)


def _remove_unpublished_data(target: str, keep: str) -> None:
    """After publishing: delete the data prefixes the manifest does not name (the previous version's,
    and those that crashed saves left)."""
    for name in _store.children(target):
        if name.startswith(_store.DATA_PREFIX) and name != keep:
            _store.remove_tree(_store.join(target, name))
