"""Lazy package attributes: a package names what it exports and where it lives, and imports it on first use,
so that importing the package (the listing, a plugin's entry point) imports neither torch nor the extras."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, table: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table`` maps each name to the module defining it; a loaded
    name is kept in ``namespace`` (the package's globals), so it is looked up once."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
