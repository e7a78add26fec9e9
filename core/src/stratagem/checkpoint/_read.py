"""Where a checkpoint's bytes are read: the checkpoint at a path as a reader finds it, on a local disk or an
object store, with what a load reads there (its format, a full file, the metadata or manifest of a sharded one,
where its DCP files are, its plain state).

Nothing read runs pickled code: a full file and ``state.pt`` go through ``torch.load(weights_only=True)``, DCP's
files through :mod:`stratagem.checkpoint._dcp`. A reader reads only what a save published (see
:mod:`stratagem.checkpoint._publish`): a sharded checkpoint on a store is the data prefix its manifest names.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from stratagem.checkpoint import _atomic, _store
from stratagem.checkpoint._state_layout import DATA_PREFIX, METADATA_FILE, STATE_FILE, check_metadata
from stratagem.errors import CheckpointError


def source(path: str | os.PathLike[str]) -> Source:
    """The checkpoint at ``path`` as a reader finds it: on a local disk once a directory swap that a crash
    interrupted is finished (every load does this first); a store URL as it is. An unknown URL scheme raises."""
    location = _store.location(path)
    if isinstance(location, str):
        return StoreSource(location)
    return LocalSource(_atomic.recover(location))


def read_json_metadata(directory: _store.Location) -> dict[str, Any]:
    """The ``stratagem.json`` of a sharded checkpoint (on a store: its manifest, written last)."""
    return _at(directory).metadata()


def read_sharded_state(path: _store.Location) -> dict[str, Any]:
    """The plain state (``state.pt``) of a sharded checkpoint, read without running pickled code.

    ``path``: the directory holding the DCP files (on a store, the data prefix the manifest names)."""
    return _at(path).read_state()


def _at(location: _store.Location) -> Source:
    return StoreSource(location) if isinstance(location, str) else LocalSource(location)


@attrs.frozen
class LocalSource:
    """A checkpoint on a local disk: a file (full) or a directory (sharded, its DCP files beside the rest)."""

    location: Path

    def format(self) -> str:
        """``"full"`` or ``"sharded"``; a path that does not exist is refused."""
        if self.location.is_dir():
            return "sharded"
        if self.location.is_file():
            return "full"
        raise CheckpointError(
            self.location, "does not exist. Pass the path of a checkpoint file or directory."
        )

    def read_full(self) -> dict[str, Any]:
        """A full checkpoint file, read without running any pickled code (its tensors mapped, not copied)."""
        try:
            payload = torch.load(self.location, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:
            raise _unreadable(self.location, error) from error
        return _checked_payload(self.location, payload)

    def metadata(self) -> dict[str, Any]:
        """The ``stratagem.json`` of a sharded checkpoint, checked."""
        file = self.location / METADATA_FILE
        try:
            if not file.is_file():
                raise _no_metadata(self.location, "directory")
            text = file.read_text()
        except FileNotFoundError as error:
            raise _no_metadata(self.location, "directory") from error
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(self.location, f"{METADATA_FILE} is unreadable: {error}") from error
        return _parsed_metadata(self.location, text)

    def data(self, meta: dict[str, Any]) -> LocalSource:
        """Where the DCP files of a sharded checkpoint are: in its directory."""
        return self

    def read_state(self) -> dict[str, Any]:
        """The plain state (``state.pt``) beside the DCP files, or ``{}`` if there is none."""
        file = self.location / STATE_FILE
        try:
            if not file.exists():
                return {}
            saved = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise _refused_state(self.location, error) from error
        return _checked_state(self.location, saved)

    def bytes_on_disk(self, data: Source | None = None) -> int:
        """What the checkpoint takes: its file, or with ``data`` (a sharded one's) every file of its directory."""
        if data is None:
            return self.location.stat().st_size
        return sum(f.stat().st_size for f in self.location.rglob("*") if f.is_file())


@attrs.frozen
class StoreSource:
    """A checkpoint on an object store: one object (full), or a manifest naming the data prefix that holds the
    DCP files and the plain state (sharded); data prefixes it does not name are not read."""

    location: str

    def format(self) -> str:
        """``"full"`` or ``"sharded"``; objects without a manifest are no checkpoint, and are refused."""
        url = self.location
        try:
            if _store.is_file(url):
                return "full"
            if _store.exists(_store.join(url, METADATA_FILE)):
                return "sharded"
            present = _store.exists(url)
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(url, f"cannot be read: {_store.describe_error(url, error)}") from error
        if present:
            raise CheckpointError(
                url,
                f"holds objects but no {METADATA_FILE} manifest: not a complete checkpoint (a save that did not "
                "finish publishes nothing). Pass the URL of a published checkpoint.",
            )
        raise CheckpointError(url, "does not exist. Pass the URL of a checkpoint object or prefix.")

    def read_full(self) -> dict[str, Any]:
        """A full checkpoint object, read without running any pickled code."""
        try:
            raw = io.BytesIO(_store.read_bytes(self.location))
            payload = torch.load(raw, map_location="cpu", weights_only=True)
        except Exception as error:
            raise _unreadable(self.location, error) from error
        return _checked_payload(self.location, payload)

    def metadata(self) -> dict[str, Any]:
        """The manifest of a sharded checkpoint (``stratagem.json``, written last), checked."""
        try:
            text = _store.read_bytes(_store.join(self.location, METADATA_FILE)).decode()
        except FileNotFoundError as error:
            raise _no_metadata(self.location, "prefix") from error
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(self.location, f"{METADATA_FILE} is unreadable: {error}") from error
        return _parsed_metadata(self.location, text)

    def data(self, meta: dict[str, Any]) -> StoreSource:
        """Where the DCP files of a sharded checkpoint are: the data prefix its manifest names."""
        data = meta.get("data")
        if not isinstance(data, str) or not data.startswith(DATA_PREFIX) or "/" in data:
            raise CheckpointError(
                self.location, f"its {METADATA_FILE} names no data prefix; it is not a stratagem manifest."
            )
        return StoreSource(_store.join(self.location, data))

    def read_state(self) -> dict[str, Any]:
        """The plain state (``state.pt``) of a data prefix, or ``{}`` if there is none."""
        try:
            try:
                raw = _store.read_bytes(_store.join(self.location, STATE_FILE))
            except FileNotFoundError:
                return {}
            saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as error:
            raise _refused_state(self.location, error) from error
        return _checked_state(self.location, saved)

    def bytes_on_disk(self, data: Source | None = None) -> int:
        """What the checkpoint takes: its object, or with ``data`` (a sharded one's data prefix) that prefix and
        the manifest."""
        if data is None:
            return _store.size(self.location)
        return _store.tree_size(data.location) + _store.size(_store.join(self.location, METADATA_FILE))


#: What :func:`source` returns: a load reads through the same methods on either.
Source = LocalSource | StoreSource


def _unreadable(location: _store.Location, error: BaseException) -> CheckpointError:
    return CheckpointError(
        location, f"cannot be read as a stratagem checkpoint (truncated, corrupt, or not one): {error}"
    )


def _checked_payload(location: _store.Location, payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise CheckpointError(location, "holds no stratagem checkpoint (the top level is not a dict).")
    check_metadata(payload.get("stratagem"), location)
    return payload


def _no_metadata(location: _store.Location, kind: str) -> CheckpointError:
    return CheckpointError(
        location,
        f"is a {kind} without {METADATA_FILE}: not a complete stratagem sharded checkpoint (an interrupted "
        "save never publishes one under the final name; check the path).",
    )


def _parsed_metadata(location: _store.Location, text: str) -> dict[str, Any]:
    try:
        meta = json.loads(text)
    except ValueError as error:
        raise CheckpointError(location, f"{METADATA_FILE} is unreadable: {error}") from error
    return check_metadata(meta, location)


def _refused_state(location: _store.Location, error: BaseException) -> CheckpointError:
    return CheckpointError(
        location, f"{STATE_FILE} is unreadable or holds more than plain data (refused): {error}"
    )


def _checked_state(location: _store.Location, saved: Any) -> dict[str, Any]:
    if not isinstance(saved, dict):
        raise CheckpointError(location, f"{STATE_FILE} holds a {type(saved).__name__}, not a dict.")
    return saved
