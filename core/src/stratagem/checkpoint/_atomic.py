"""Atomic replacement of a checkpoint file or directory: write beside it, fsync, then rename.

A crash at any moment leaves either the previous checkpoint or the new one, never a mixture.

Files are replaced by one ``rename``. Directories are swapped with Linux's ``renameat2(RENAME_EXCHANGE)``
where the kernel and file system offer it (one atomic step); elsewhere the previous directory is first
renamed aside and :func:`recover` puts it back if a crash falls between the two renames.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OLD_SUFFIX = ".stratagem-old"
TMP_MARK = ".stratagem-tmp-"

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def temporary_sibling(path: Path) -> Path:
    """A fresh name beside ``path`` to write into before publishing; a later run recognises it as debris."""
    return path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:10]}")


def old_sibling(path: Path) -> Path:
    return path.with_name(path.name + OLD_SUFFIX)


def fsync_path(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk, so a rename publishes written data."""
    for current, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(current) / name)
        fsync_path(Path(current))


def remove(path: Path) -> None:
    """Remove a file, link or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _written(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return 0


def explain_write_failure(tmp: Path, error: BaseException, text: str | None = None) -> str:
    """Why writing ``tmp`` failed, in words; torch's own writer reports a full disk as "unexpected pos"."""
    text = text or f"{type(error).__name__}: {error}"
    code = getattr(error, "errno", None)
    written = _written(tmp)
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        free = None
    limit = resource_file_size_limit()
    if code == errno.ENOSPC or (free is not None and free < 1 << 20 and code is None):
        return (
            f"{text} (the file system is full: {free} bytes free after writing {written} bytes of the "
            "checkpoint). Free some space or save elsewhere."
        )
    if code == errno.EFBIG or (limit is not None and written >= limit):
        return f"{text} (the file size limit, ulimit -f, is {limit} bytes). Raise it or save elsewhere."
    return text


def resource_file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


class WriteError(OSError):
    """Writing a checkpoint's temporary failed; the message says why in words."""


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success it replaces ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        try:
            yield tmp
        except Exception as error:
            raise WriteError(explain_write_failure(tmp, error)) from error
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def libc_function(name: str, *argtypes: Any) -> Any:
    """Linux's C library function ``name`` (returning an int, errno kept), or None where there is none: another
    system, or a C library without it (``renameat2`` before glibc 2.28, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = libc_function(
    "renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
)


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the system cannot (then nothing changed)."""
    if _RENAMEAT2 is None:
        return False
    result = _RENAMEAT2(  # type: ignore[operator]
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of {first} and {second}: {os.strerror(code)}")


def publish_directory(tmp: Path, path: Path) -> None:
    """Put the finished directory ``tmp`` in place of ``path``.

    With an atomic exchange, ``tmp`` then holds the previous checkpoint and is removed; a crash before the
    removal leaves a stale temporary that the next save deletes. Without it, the previous directory is
    renamed aside to ``<name>.stratagem-old`` first: a crash between the two renames leaves it whole under
    that name, and :func:`recover` (run by every load and save) puts it back.
    """
    fsync_tree(tmp)
    recover(path)
    if path.is_dir() and not path.is_symlink() and exchange(tmp, path):
        fsync_path(path.parent)
        remove(tmp)
        return
    old = old_sibling(path)
    remove(old)
    if path.exists() or path.is_symlink():
        os.replace(path, old)
        fsync_path(path.parent)
    try:
        os.replace(tmp, path)
    except BaseException:
        recover(path)
        raise
    fsync_path(path.parent)
    remove(old)


def recover(path: Path) -> Path:
    """Undo a directory swap that a crash interrupted; return the path to read."""
    old = old_sibling(path)
    if not path.exists() and not path.is_symlink() and old.exists():
        # Several ranks may race here: whoever loses finds ``old`` gone, which is the same outcome.
        with contextlib.suppress(FileNotFoundError):
            os.replace(old, path)
    return path


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries that crashed saves of ``path`` left behind."""
    if not path.parent.is_dir():
        return
    for sibling in path.parent.glob(f"{glob.escape(path.name)}{TMP_MARK}*"):
        remove(sibling)
