"""Each module of the core has a file name of its own: a name says what the module does, and a newcomer who
searches for it finds one file (``_builtin`` in four packages, or ``_checkpoints`` in two, said neither)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import stratagem

CORE = Path(stratagem.__file__).parent


def _name(stem: str) -> str:
    """The name a reader hears: without a leading underscore or a plural's s (``_layout`` and ``layouts`` are
    one name)."""
    name = stem.lstrip("_")
    return name[:-1] if name.endswith("s") and not name.endswith("ss") else name


def test_no_two_core_modules_share_a_file_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in CORE.rglob("*.py"):
        if path.name != "__init__.py" and "templates" not in path.parts:
            where[_name(path.stem)].append(str(path.relative_to(CORE)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"core modules that share a name (rename one to say what it does): {shared}"
