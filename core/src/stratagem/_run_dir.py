"""A run's checkpoint directory: ``step-NNNNNN[.ckpt]`` names, the ``last`` pointer, finding the newest complete
checkpoint and pruning old ones."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from stratagem.checkpoint import METADATA_FILE
from stratagem.checkpoint._atomic import atomic_file

CHECKPOINT_DIR = "checkpoints"
LAST_POINTER = "last"
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)(\.ckpt)?$")


def checkpoint_name(step: int, format: str) -> str:
    return f"step-{step:06d}" + (".ckpt" if format == "full" else "")


def publish_last(directory: Path, name: str) -> None:
    """Point ``directory/last`` at ``name`` (atomically: a reader sees the old pointer or the new one)."""
    with atomic_file(directory / LAST_POINTER) as tmp:
        tmp.write_text(name + "\n")


def checkpoint_step(path: Path) -> int | None:
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    if path.is_file():
        return path.stat().st_size > 0
    return path.is_dir() and (path / METADATA_FILE).is_file()


def find_last_checkpoint(directory: Path) -> Path | None:
    """The checkpoint ``directory/last`` names, if complete; else the newest complete ``step-*``."""
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


def prune(directory: Path, *, keep: int, protect: str) -> None:
    checkpoints = sorted((step, p) for p in directory.iterdir() if (step := checkpoint_step(p)) is not None)
    for _, path in checkpoints[:-keep]:
        if path.name == protect:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
