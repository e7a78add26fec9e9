"""A run's checkpoint directory: ``step-NNNNNN[.ckpt]`` names, the ``last`` pointer, finding the newest complete
checkpoint and pruning old ones. The directory is a local path or an object-store URL (see
docs/checkpoints.md, "Object stores": ``last`` is an object written after the checkpoint's own publication, and
pruning deletes a sharded checkpoint's manifest before its data, so a half-deleted one is never complete)."""

from __future__ import annotations

import re
import shutil

from stratagem.checkpoint import METADATA_FILE, _store
from stratagem.checkpoint._atomic import atomic_file
from stratagem.checkpoint._store import Location

CHECKPOINT_DIR = "checkpoints"
LAST_POINTER = "last"
_POINTER_MAX_BYTES = 256  # a checkpoint's name and a newline; any checkpoint file is far larger
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)(\.ckpt)?$")


def checkpoint_name(step: int, format: str) -> str:
    return f"step-{step:06d}" + (".ckpt" if format == "full" else "")


def publish_last(directory: Location, name: str) -> None:
    """Point ``directory/last`` at ``name`` (atomically: a reader sees the old pointer or the new one)."""
    if isinstance(directory, str):
        _store.write_bytes(_store.join(directory, LAST_POINTER), (name + "\n").encode())
        return
    with atomic_file(directory / LAST_POINTER) as tmp:
        tmp.write_text(name + "\n")


def checkpoint_step(path: Location) -> int | None:
    match = _CHECKPOINT_NAME.match(_store.name_of(path))
    return int(match.group(1)) if match else None


def is_complete(path: Location) -> bool:
    if isinstance(path, str):
        if _store.is_file(path):
            return _store.size(path) > 0
        return _store.exists(_store.join(path, METADATA_FILE))
    if path.is_file():
        return path.stat().st_size > 0
    return path.is_dir() and (path / METADATA_FILE).is_file()


def find_last_checkpoint(directory: Location) -> Location | None:
    """The checkpoint ``directory/last`` names, if complete; else the newest complete ``step-*``."""
    if isinstance(directory, str):
        return _find_last_remote(directory)
    pointer = directory / LAST_POINTER
    if pointer.is_file():
        named = directory / pointer.read_text().strip()
        if named.name and is_complete(named):
            return named
    if not directory.is_dir():
        return None
    candidates = sorted(
        (step, p) for p in directory.iterdir() if (step := checkpoint_step(p)) is not None and is_complete(p)
    )
    return candidates[-1][1] if candidates else None


def find_verified_checkpoint(directory: Location) -> tuple[Location | None, list[str]]:
    """The newest complete checkpoint of ``directory`` that verifies against its checksums (``last`` first, as
    :func:`find_last_checkpoint`), and a line for each newer one skipped because it does not. Nothing is
    deleted."""
    from stratagem.checkpoint._verify import steps_newest_first, verify

    first = find_last_checkpoint(directory)
    if first is None:
        return None, []
    ordered = [first] + [c for c in steps_newest_first(directory) if str(c) != str(first)]
    skipped = []
    for candidate in ordered:
        if not is_complete(candidate):
            continue
        report = verify(candidate)
        if report.passed:
            return candidate, skipped
        failure = report.first_failure()
        skipped.append(f"{_store.name_of(candidate)} ({failure.describe() if failure else 'fails'})")
    return None, skipped


def pointer_directory(path: Location) -> Location | None:
    """The run directory whose ``last`` pointer ``path`` is; None when ``path`` is not such a pointer (a
    checkpoint that happens to be named ``last``, say)."""
    if _store.name_of(path) != LAST_POINTER:
        return None
    try:
        if isinstance(path, str):
            small = _store.is_file(path) and _store.size(path) <= _POINTER_MAX_BYTES
            text = _store.read_bytes(path) if small else b""
        else:
            small = path.is_file() and path.stat().st_size <= _POINTER_MAX_BYTES
            text = path.read_bytes() if small else b""
        named = text.decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if checkpoint_step(named) is None:
        return None
    return path.rstrip("/").rsplit("/", 1)[0] if isinstance(path, str) else path.parent


def _find_last_remote(directory: str) -> str | None:
    try:
        named = _store.read_bytes(_store.join(directory, LAST_POINTER)).decode().strip()
    except FileNotFoundError:
        named = ""
    if named and "/" not in named and is_complete(_store.join(directory, named)):
        return _store.join(directory, named)
    candidates = sorted(
        (step, name)
        for name in _store.children(directory)
        if (step := checkpoint_step(name)) is not None and is_complete(_store.join(directory, name))
    )
    return _store.join(directory, candidates[-1][1]) if candidates else None


def remove_checkpoint(target: Location) -> None:
    """Delete one checkpoint (file or directory, local or on a store); a store's manifest goes first, so that
    from then on the prefix is no checkpoint, whatever is left of it."""
    if isinstance(target, str):
        _store.remove_object(_store.join(target, METADATA_FILE))
        _store.remove_tree(target)
    elif target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def prune(directory: Location, *, keep: int, protect: str) -> None:
    if isinstance(directory, str):
        names = sorted(
            (step, n) for n in _store.children(directory) if (step := checkpoint_step(n)) is not None
        )
        for _, name in names[:-keep]:
            if name != protect:
                remove_checkpoint(_store.join(directory, name))
        return
    checkpoints = sorted((step, p) for p in directory.iterdir() if (step := checkpoint_step(p)) is not None)
    for _, path in checkpoints[:-keep]:
        if path.name != protect:
            remove_checkpoint(path)
