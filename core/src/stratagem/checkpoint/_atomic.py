"""Atomic replacement of a checkpoint file or directory: write beside it, fsync, then rename.

A crash at any moment leaves either the previous checkpoint or the new one, never a mixture.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

OLD_SUFFIX = ".stratagem-old"
TMP_MARK = ".stratagem-tmp-"


def temporary_sibling(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:10]}")


def fsync_path(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for current, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(current) / name)
        fsync_path(Path(current))


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success it replaces ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def publish_directory(tmp: Path, path: Path) -> None:
    """Put the finished directory ``tmp`` in place of ``path``.

    A file can be replaced by one rename; a directory cannot, so the previous one is first renamed aside to
    ``<name>.stratagem-old`` and removed after. A crash between the two renames leaves the previous checkpoint
    whole under that name, and :func:`recover` puts it back.
    """
    fsync_tree(tmp)
    old = path.with_name(path.name + OLD_SUFFIX)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if path.exists() or path.is_symlink():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_path(path.parent)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def recover(path: Path) -> Path:
    """Undo a directory swap that a crash interrupted; return the path to read."""
    old = path.with_name(path.name + OLD_SUFFIX)
    if not path.exists() and old.exists():
        with contextlib.suppress(FileNotFoundError):
            os.replace(old, path)
    return path


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries that crashed saves of ``path`` left behind."""
    if not path.parent.is_dir():
        return
    for sibling in path.parent.glob(f"{path.name}{TMP_MARK}*"):
        shutil.rmtree(sibling, ignore_errors=True) if sibling.is_dir() else sibling.unlink(missing_ok=True)
