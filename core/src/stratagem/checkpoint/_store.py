"""Checkpoint locations: local paths, or object-store URLs reached through fsspec.

A location is a :class:`~pathlib.Path` (a local path, or a ``file://`` URL turned into one) or a ``str``
URL of an object store (``s3://``, ``gs://``, ``az://``, ``memory://``). How a save is published at either is
:mod:`stratagem.checkpoint._publish`'s (see docs/checkpoints.md, "Atomic publication").

fsspec and the store's package are imported on first use of a URL only, never at ``import stratagem``.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stratagem.checkpoint import _scratch
from stratagem.errors import CheckpointError

#: URL scheme -> (the fsspec package that serves it, the stratagem extra that installs it).
SCHEMES: dict[str, tuple[str | None, str | None]] = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "memory": (None, None),
}

Location = Path | str


def scheme_of(path: object) -> str | None:
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or "://" not in text:
        return None
    return text.split("://", 1)[0].lower()


def is_remote(location: object) -> bool:
    """True for a store URL kept as ``str`` (``file://`` and plain paths are local)."""
    return isinstance(location, str) and scheme_of(location) not in (None, "file")


def location(path: str | os.PathLike[str]) -> Location:
    """A ``Path`` for local paths and ``file://`` URLs; the URL itself (no trailing slash) for a store.

    An unknown scheme raises, naming the supported ones and the extra to install.
    """
    if isinstance(path, Path):
        return path
    text = os.fspath(path)
    scheme = scheme_of(text)
    if scheme is None:
        return Path(text)
    if scheme == "file":
        return Path(text[len("file://") :])
    if scheme not in SCHEMES:
        supported = ", ".join(f"{s}://" for s in ["file", *SCHEMES])
        close = difflib.get_close_matches(scheme, list(SCHEMES), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]}://?" if close else ""
        raise CheckpointError(
            text,
            f"uses the URL scheme {scheme!r}, which stratagem's checkpoints do not support.{hint} Supported: "
            f"{supported} and local paths (install stratagem[s3], stratagem[gcs] or stratagem[azure] for the "
            "stores).",
        )
    return text.rstrip("/")


def join(base: Location, *names: str) -> Location:
    if isinstance(base, Path):
        return base.joinpath(*names)
    return "/".join([base.rstrip("/"), *names])


def name_of(loc: Location) -> str:
    return loc.name if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[-1]


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system serving ``url`` and the path inside it. Missing packages raise with the extra."""
    scheme = scheme_of(url) or ""
    package, extra = SCHEMES.get(scheme, (None, None))
    try:
        from fsspec.core import url_to_fs
    except ImportError as error:
        raise CheckpointError(
            url, f"is an object-store URL, which needs fsspec: pip install 'stratagem[{extra or 's3'}]'."
        ) from error
    try:
        return url_to_fs(url)
    except ImportError as error:
        raise CheckpointError(
            url,
            f"needs the {package} package for {scheme}:// URLs: pip install 'stratagem[{extra}]' ({error}).",
        ) from error


def fs_path(url: str) -> str:
    return filesystem(url)[1]


def _fresh(url: str) -> Any:
    fs, _ = filesystem(url)
    # Several processes write the same store: never trust a listing cached before their writes.
    fs.invalidate_cache()
    return fs


def exists(url: str) -> bool:
    fs = _fresh(url)
    return bool(fs.exists(fs_path(url)))


def is_file(url: str) -> bool:
    fs = _fresh(url)
    try:
        return bool(fs.isfile(fs_path(url)))
    except FileNotFoundError:
        return False


def check_bucket(url: str) -> None:
    """Refuse a URL whose bucket (container) is missing: fsspec's ``makedirs``, which DCP's writer calls,
    would otherwise create it, with whatever defaults the account has."""
    if scheme_of(url) == "memory":
        return
    fs, path = filesystem(url)
    bucket = path.split("/", 1)[0]
    fs.invalidate_cache()
    if not fs.exists(bucket):
        raise CheckpointError(
            url,
            f"the bucket {bucket!r} does not exist: create it (stratagem does not create buckets) or fix the URL.",
        )


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    return fs.cat_file(path)


def write_bytes(url: str, data: bytes) -> None:
    """One object, in one request: a reader sees the previous object or this one, never a part."""
    fs, path = filesystem(url)
    fs.pipe_file(path, data)


def size(url: str) -> int:
    fs = _fresh(url)
    return int(fs.size(fs_path(url)))


def tree_size(url: str) -> int:
    fs = _fresh(url)
    return int(fs.du(fs_path(url), total=True))


def children(url: str) -> list[str]:
    """The names directly under ``url`` (objects and prefixes), or [] if there are none."""
    fs = _fresh(url)
    try:
        entries = fs.ls(fs_path(url), detail=False)
    except FileNotFoundError:
        return []
    return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})


def remove_tree(url: str) -> None:
    fs = _fresh(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(fs_path(url), recursive=True)


def remove_object(url: str) -> None:
    fs, path = filesystem(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


@contextlib.contextmanager
def upload(url: str) -> Iterator[Path]:
    """Yield a local scratch file; on success it becomes the object ``url`` in one upload.

    fsspec's ``put_file`` sends a single PUT or a multipart upload completed only at its end (aborted on
    error), so the object never exists half-written, whatever happens to this process. The scratch file is
    named after this process, so that a save after this one was killed removes it (see stratagem.checkpoint._scratch).
    """
    with _scratch.file("upload") as scratch:
        yield scratch
        fs, path = filesystem(url)
        fs.put_file(str(scratch), path)


def describe_error(url: str, error: BaseException) -> str:
    """The store's own error, with a hint for the usual causes."""
    text = f"{type(error).__name__}: {error}"
    lowered = text.lower()
    if "nosuchbucket" in lowered or "bucket does not exist" in lowered or "no such bucket" in lowered:
        return f"{text} (the bucket does not exist: create it or fix the URL)"
    refused = ("accessdenied", "access denied", "invalidaccesskeyid", "signaturedoesnotmatch", "forbidden")
    if isinstance(error, PermissionError) or any(k in lowered for k in refused):
        return (
            f"{text} (the store refused the request: check the credentials, e.g. AWS_ACCESS_KEY_ID or "
            "AWS_PROFILE, and their permissions on this bucket)"
        )
    return text


def local_dir(root: Location) -> Path:
    """Where a run keeps its local files (``metrics.csv``): ``root`` itself, or for a store URL
    ``runs/<scheme>/<bucket and prefix>`` under the working directory (checkpoints still go to the store)."""
    if isinstance(root, Path):
        return root
    scheme, rest = root.split("://", 1)
    return Path("runs", scheme, *[part for part in rest.split("/") if part not in ("", ".", "..")])
