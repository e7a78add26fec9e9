"""Verifying a whole checkpoint against the checksums it recorded (``stratagem checkpoint verify``), and finding
the newest checkpoint beside a failing one that verifies (what a load's error names, what ``ckpt_path="last"``
and a restart fall back to). Nothing here deletes anything."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import attrs

from stratagem.checkpoint import _checksum, _read, _store
from stratagem.checkpoint._state_layout import METADATA_FILE
from stratagem.errors import CheckpointError

_STEP = re.compile(r"^step-(\d+)(\.ckpt)?$")

OK, MISMATCH, MISSING, NO_CHECKSUMS, UNREADABLE = "ok", "MISMATCH", "MISSING", "no checksums", "UNREADABLE"


@attrs.frozen
class FileCheck:
    """One file of a checkpoint: its name, what was found (:data:`OK`, :data:`MISMATCH`, ...), the checksums."""

    name: str
    status: str
    expected: str = ""
    found: str = ""

    def describe(self) -> str:
        if self.status == MISMATCH:
            return f"{self.status:<12} {self.name}: expected {self.expected}, found {self.found}"
        detail = f" ({self.found})" if self.found else ""
        return f"{self.status:<12} {self.name}{detail}"


@attrs.frozen
class Report:
    """What verifying one checkpoint found. ``passed``: no file failed (a checkpoint without checksums passes,
    and says so)."""

    path: str
    files: tuple[FileCheck, ...]

    @property
    def passed(self) -> bool:
        return all(f.status in (OK, NO_CHECKSUMS) for f in self.files)

    @property
    def checksummed(self) -> bool:
        return not any(f.status == NO_CHECKSUMS for f in self.files)

    def first_failure(self) -> FileCheck | None:
        return next((f for f in self.files if f.status not in (OK, NO_CHECKSUMS)), None)


def verify(path: str | os.PathLike[str]) -> Report:
    """Check every file of the checkpoint at ``path`` (local or a store URL) against its recorded checksum."""
    source = _read.source(path)
    where = str(source.location)
    try:
        fmt = source.format()
    except CheckpointError as error:
        return Report(where, (FileCheck(_store.name_of(source.location), MISSING, found=error.problem),))
    if fmt == "full":
        return Report(where, (_verify_full(source),))
    return Report(where, tuple(_verify_sharded(source)))


def _verify_full(source: Any) -> FileCheck:
    name = _store.name_of(source.location)
    try:
        expected, found = _checksum.full_file_status(source.location)
    except OSError as error:
        return FileCheck(name, UNREADABLE, found=str(error))
    if expected is None:
        try:  # no trailer: an old checkpoint, or one whose trailer was cut off (its metadata says which)
            source.read_full()
        except CheckpointError as error:
            return FileCheck(name, UNREADABLE, found=error.problem)
        return FileCheck(name, NO_CHECKSUMS)
    if expected.startswith("?"):
        return FileCheck(name, MISMATCH, expected[1:], "a file of another length (truncated or extended)")
    return FileCheck(name, OK if expected == found else MISMATCH, expected, str(found))


def _verify_sharded(source: Any) -> list[FileCheck]:
    try:
        meta = source.metadata()
        data = source.data(meta)
    except _checksum.ChecksumError as error:
        return [FileCheck(METADATA_FILE, MISMATCH, error.expected, error.found)]
    except CheckpointError as error:
        return [FileCheck(METADATA_FILE, UNREADABLE, found=error.problem)]
    sums = _read.file_checksums(meta)
    if sums is None:
        return [FileCheck(METADATA_FILE, NO_CHECKSUMS)]
    checks = [FileCheck(METADATA_FILE, OK)]
    for name, expected in sums.items():
        try:
            found = _checksum.crc_of(_store.join(data.location, name))
        except FileNotFoundError:
            checks.append(FileCheck(name, MISSING, expected, "no such file"))
            continue
        except OSError as error:
            checks.append(FileCheck(name, UNREADABLE, expected, str(error)))
            continue
        checks.append(FileCheck(name, OK if found == expected else MISMATCH, expected, found))
    return checks


def steps_newest_first(directory: _store.Location) -> list[_store.Location]:
    """The ``step-*`` entries of a run's checkpoint directory, newest first (complete or not)."""
    if isinstance(directory, Path):
        names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    else:
        names = _store.children(directory)
    steps = sorted(((int(m.group(1)), n) for n in names if (m := _STEP.match(n))), reverse=True)
    return [_store.join(directory, name) for _, name in steps]


def newest_verified_beside(path: str | os.PathLike[str] | Path) -> str | None:
    """The newest other checkpoint of the run directory holding ``path`` (``step-*`` beside it) that verifies,
    or None."""
    location = _store.location(path)
    parent = location.parent if isinstance(location, Path) else location.rsplit("/", 1)[0]
    for candidate in steps_newest_first(parent):
        if str(candidate) != str(location) and verify(candidate).passed:
            return str(candidate)
    return None


def advice(path: str | os.PathLike[str] | Path) -> str:
    """What a load that failed verification says to do: the newest checkpoint beside it that verifies."""
    try:
        good = newest_verified_beside(path)
    except Exception:  # a listing that fails must not hide the checksum error itself
        good = None
    if good is None:
        return "No other checkpoint beside it verifies; nothing was deleted."
    return f"The newest complete checkpoint beside it that verifies is {good}; nothing was deleted."
