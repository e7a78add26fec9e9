"""Scratch files and folders in the temporary directory, never left there for good.

A process that ends normally removes its own scratch; a killed one cannot (a SIGKILL during a save to S3 leaves
the local copy of the checkpoint it was uploading, a killed launcher its agent's folder). So every scratch
entry's name says who made it: ``stratagem-<kind>-<pid>-<start>-<machine>-<random>``, with the process's start
time (which tells a reused process id apart) and a digest of the host name and the pid namespace (a temporary
directory shared with another machine or container holds process ids that mean nothing here). Whoever makes a
new entry first removes those whose maker is gone. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

_NAME = re.compile(r"^stratagem-[a-z]+-(\d+)-(\d+)-([0-9a-f]{8})-")


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), 0 where /proc cannot say, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
        try:  # no /proc (macOS): whether the process exists is all there is to know
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: count the fields after its closing one.
    return int(stat.rsplit(")", 1)[1].split()[19])


@functools.cache
def _machine() -> str:
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha1(f"{socket.gethostname()}|{namespace}".encode()).hexdigest()[:8]


def _prefix(kind: str) -> str:
    pid = os.getpid()
    return f"stratagem-{kind}-{pid}-{_started(pid) or 0}-{_machine()}-"


def _orphaned(name: str) -> bool:
    match = _NAME.match(name)
    if match is None or match.group(3) != _machine():
        return False
    pid, started = int(match.group(1)), int(match.group(2))
    now = _started(pid)
    return now is None or (now != 0 and started != 0 and now != started)


def sweep(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the scratch entries under ``directory`` (the temporary directory) whose maker is gone."""
    where = Path(directory or tempfile.gettempdir())
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        entries = list(os.scandir(where))
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not entry.name.startswith("stratagem-") or not _orphaned(entry.name):
            continue
        try:
            # Another user's are theirs to remove (a shared temporary directory): never touch them.
            if uid is not None and entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:  # gone already (another process swept it), or not ours to remove
            continue
        removed.append(entry.name)
    return removed


def make_dir(kind: str) -> Path:
    """A new private folder (mode 0700) in the temporary directory; the caller removes it."""
    sweep()
    return Path(tempfile.mkdtemp(prefix=_prefix(kind)))


def make_file(kind: str, suffix: str = "") -> Path:
    """A new empty private file (mode 0600) in the temporary directory; the caller removes it."""
    sweep()
    handle, name = tempfile.mkstemp(prefix=_prefix(kind), suffix=suffix)
    os.close(handle)
    return Path(name)


@contextlib.contextmanager
def folder(kind: str) -> Iterator[Path]:
    """A scratch folder for the block, removed when the block ends, however it ends."""
    path = make_dir(kind)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def file(kind: str, suffix: str = "") -> Iterator[Path]:
    """A scratch file for the block, removed when the block ends, however it ends."""
    path = make_file(kind, suffix)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
