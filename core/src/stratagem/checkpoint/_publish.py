"""Where a save is published: the checkpoint's destination, a local path or an object-store URL, with each step
a save takes there.

A save never writes under the checkpoint's own name before it is complete, so a crash at any moment leaves the
previous checkpoint whole; publication is the one step that makes the new one the checkpoint:

- on a local disk (:class:`LocalDestination`) everything is written beside the checkpoint (a temporary sibling),
  fsynced, then renamed into place (the renames are :mod:`stratagem.checkpoint._atomic`'s);
- an object store (:class:`StoreDestination`) has no rename: a full checkpoint is one upload, and a sharded one is
  written under a fresh data prefix that its manifest, written last, names (:mod:`stratagem.checkpoint._store`
  reaches the store).

The bytes themselves are written by :mod:`stratagem.checkpoint._write`, into what these methods hand out.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from stratagem.checkpoint import _atomic, _store
from stratagem.checkpoint._state_layout import DATA_PREFIX, METADATA_FILE
from stratagem.errors import CheckpointError


def destination(path: str | os.PathLike[str]) -> Destination:
    """Where a save of ``path`` goes. An unknown URL scheme raises here, naming the supported ones."""
    location = _store.location(path)
    if isinstance(location, str):
        return StoreDestination(location)
    return LocalDestination(location)


@attrs.frozen
class LocalDestination:
    """A checkpoint on a local disk: written beside its path, fsynced, then renamed into place."""

    location: Path

    def prepare(self, fmt: str, staging: Path | None = None) -> None:
        """Rank 0, before writing: refuse a path of the other kind, finish a swap that a crash interrupted,
        remove what crashed saves left; then make a sharded save's staging directory."""
        target = self.location
        if fmt == "full" and target.is_dir():
            raise CheckpointError(
                target, "is a directory; a full checkpoint is one file. Choose another path."
            )
        if fmt == "sharded" and target.is_file():
            raise CheckpointError(
                target, "is a file; a sharded checkpoint is a directory. Choose another path."
            )
        for parent in target.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise CheckpointError(
                        target,
                        f"cannot be created: {parent} is a file, not a directory. Choose another path.",
                    )
                break
        _atomic.recover(target)
        _atomic.remove_stale_temporaries(target)
        if staging is not None:
            staging.mkdir(parents=True)

    def full_file(self) -> contextlib.AbstractContextManager[Path]:
        """Rank 0: a temporary file beside the checkpoint to write a full checkpoint into; renamed into place
        once written."""
        return _atomic.atomic_file(self.location)

    def staging(self, strategy: Any) -> Path:
        """Where a sharded save writes until it is published: a fresh temporary sibling, the same on every rank
        (rank 0 draws it: a collective)."""
        return Path(strategy.broadcast(str(_atomic.temporary_sibling(self.location)), 0))

    @contextlib.contextmanager
    def staged_file(self, staging: Path, name: str) -> Iterator[Path]:
        """Rank 0: the file ``name`` of the staging directory, to write into."""
        try:
            yield staging / name
        except Exception as error:
            raise _atomic.WriteError(_atomic.explain_write_failure(staging, error)) from error

    def write_failure(self, staging: Path, error: BaseException, text: str) -> _atomic.WriteError:
        """Why writing into ``staging`` failed, in words (a full disk, the file size limit)."""
        return _atomic.WriteError(_atomic.explain_write_failure(staging, error, text))

    def publish(self, staging: Path, meta: dict[str, Any]) -> None:
        """Rank 0, once every rank's files are in ``staging``: the metadata, then the directory renamed into
        place (swapped with the previous one where the system can)."""
        try:
            (staging / METADATA_FILE).write_text(json.dumps(meta, indent=2))
        except Exception as error:
            raise _atomic.WriteError(_atomic.explain_write_failure(staging, error)) from error
        _atomic.publish_directory(staging, self.location)

    def discard(self, staging: Path) -> None:
        """Rank 0, after a failure: remove what the save wrote."""
        _atomic.remove(staging)


@attrs.frozen
class StoreDestination:
    """A checkpoint on an object store, which has no rename: a full checkpoint is one upload (a reader sees the
    previous object or the new one); a sharded one is written under a fresh data prefix and exists from the
    single request that writes its manifest, naming that prefix."""

    location: str

    def prepare(self, fmt: str, staging: str | None = None) -> None:
        """Rank 0, before writing: refuse a missing bucket (stratagem never creates one) and a URL of the other
        kind. A data prefix needs no making."""
        url = self.location
        try:
            _store.check_bucket(url)
            if fmt == "full" and _store.exists(_store.join(url, METADATA_FILE)):
                raise CheckpointError(
                    url, "holds a sharded checkpoint; a full checkpoint is one object. Choose another URL."
                )
            if fmt == "sharded" and _store.is_file(url):
                raise CheckpointError(
                    url,
                    "is an object (a full checkpoint); a sharded checkpoint is a prefix. Choose another URL.",
                )
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(url, _store.describe_error(url, error)) from error

    @contextlib.contextmanager
    def full_file(self) -> Iterator[Path]:
        """Rank 0: a local scratch file to write a full checkpoint into; uploaded as the checkpoint's one object
        once written."""
        try:
            with _store.upload(self.location) as file:
                yield file
        except Exception as error:
            raise _atomic.WriteError(_store.describe_error(self.location, error)) from error

    def staging(self, strategy: Any) -> str:
        """Where a sharded save writes: a fresh data prefix under the checkpoint's URL, the same on every rank
        (rank 0 draws it: a collective). No manifest names it until publication."""
        return _store.join(self.location, strategy.broadcast(f"{DATA_PREFIX}{uuid.uuid4().hex[:12]}", 0))

    @contextlib.contextmanager
    def staged_file(self, staging: str, name: str) -> Iterator[Path]:
        """Rank 0: a local scratch file, uploaded as the object ``name`` of the data prefix once written."""
        try:
            with _store.upload(_store.join(staging, name)) as file:
                yield file
        except Exception as error:
            raise _atomic.WriteError(_store.describe_error(self.location, error)) from error

    def write_failure(self, staging: str, error: BaseException, text: str) -> _atomic.WriteError:
        """The store's own error, with a hint for the usual causes."""
        return _atomic.WriteError(_store.describe_error(staging, error))

    def publish(self, staging: str, meta: dict[str, Any]) -> None:
        """Rank 0, once every rank's shards and DCP's index are under ``staging``: the manifest naming it (the
        checkpoint exists from that one request on), then the data prefixes it does not name are deleted (the
        previous version's, and those that crashed saves left)."""
        data_name = _store.name_of(staging)
        manifest = json.dumps({**meta, "data": data_name}, indent=2).encode()
        try:
            _store.write_bytes(_store.join(self.location, METADATA_FILE), manifest)
        except Exception as error:
            raise _atomic.WriteError(_store.describe_error(self.location, error)) from error
        for name in _store.children(self.location):
            if name.startswith(DATA_PREFIX) and name != data_name:
                _store.remove_tree(_store.join(self.location, name))

    def discard(self, staging: str) -> None:
        """Rank 0, after a failure: delete what the save wrote (what is left is ignored, and the next publication
        deletes it)."""
        with contextlib.suppress(Exception):
            _store.remove_tree(staging)


#: What :func:`destination` returns: the steps of a save are the same methods on either.
Destination = LocalDestination | StoreDestination
