"""Installed distributions and their entry points, read from the ``*.dist-info`` and ``*.egg-info`` folders on
``sys.path`` as importlib.metadata finds them, without importing it.

Why: ``stratagem strategies`` needs only the entry points of one group and, for the few distributions that
declare them, their name and version. importlib_metadata's import, its scan and the e-mail parser it reads
every ``METADATA`` with took about 45 ms of the listing's start-up (benchmarks/README.md, listing.py). The
same search rules apply (path order, the first distribution of a name wins, the lexically greatest folder of
a name within one path entry first), checked against importlib_metadata in core/tests/test_installed.py.
Where those rules are not enough (a zip file on ``sys.path``, an import hook that supplies distributions of
its own) the search goes to importlib_metadata.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from typing import Any

_INFO_SUFFIXES = (".dist-info", ".egg-info")
#: ``module``, ``module:attr.sub`` and either with ``[extras]``, as the entry-point specification writes them.
_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


def normalize(name: str) -> str:
    """A distribution name as the metadata folders are matched (PEP 503, with underscores)."""
    return re.sub(r"[-_.]+", "_", name).lower()


class Distribution:
    """One installed distribution: its metadata folder; the name and version from the metadata's headers."""

    __slots__ = ("_headers", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._headers: dict[str, str] | None = None

    def read_text(self, filename: str) -> str | None:
        try:
            with open(os.path.join(self.path, filename) if filename else self.path, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None

    def _header(self, key: str) -> str | None:
        if self._headers is None:
            self._headers = _headers(
                self.read_text("METADATA") or self.read_text("PKG-INFO") or self.read_text("") or ""
            )
        return self._headers.get(key.lower())

    @property
    def name(self) -> str:
        return self._header("Name") or _name_from_folder(os.path.basename(self.path))

    @property
    def version(self) -> str:
        return self._header("Version") or ""

    def __repr__(self) -> str:
        return f"Distribution({self.path!r})"


def _headers(text: str) -> dict[str, str]:
    """The metadata's header fields (the first of each name, lower-cased keys), up to the first empty line; a
    line that starts with white space continues the field before it."""
    fields: dict[str, str] = {}
    key: str | None = None
    for line in text.splitlines():
        if not line.strip():
            break
        if line[0] in " \t":
            if key is not None:
                fields[key] += " " + line.strip()
            continue
        name, sep, value = line.partition(":")
        key = name.strip().lower() if sep else None
        if key is not None:
            if key in fields:
                key = None  # a repeated field: the first one counts
            else:
                fields[key] = value.strip()
    return fields


def _name_from_folder(folder: str) -> str:
    return folder.rpartition(".")[0].partition("-")[0]


class EntryPoint:
    """One ``name = value`` line of a distribution's ``entry_points.txt``."""

    __slots__ = ("dist", "group", "name", "value")

    def __init__(self, name: str, value: str, group: str, dist: Distribution | None) -> None:
        self.name, self.value, self.group, self.dist = name, value, group, dist

    def load(self) -> Any:
        """The module the value names, or the attribute after its ``:``."""
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(
                f"entry point {self.name!r}: {self.value!r} is not 'module' or 'module:attribute'"
            )
        module = importlib.import_module(match.group("module"))
        return functools.reduce(getattr, filter(None, (match.group("attr") or "").split(".")), module)

    def __repr__(self) -> str:
        return f"EntryPoint(name={self.name!r}, value={self.value!r}, group={self.group!r})"


class _Unsupported(Exception):
    """This environment has distributions the folder scan cannot see: ask importlib_metadata."""


#: Each directory's metadata folders, kept while its modification time stays (installing or removing a
#: distribution adds or removes a folder, which changes it): ``{path: (mtime, [(normalized name, folder)])}``.
_folders_cache: dict[str, tuple[float, list[tuple[str, str]]]] = {}


def _folders(entry: str) -> list[tuple[str, str]]:
    root = entry or "."
    try:
        mtime = os.stat(root).st_mtime
    except OSError:
        return []
    cached = _folders_cache.get(root)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    try:
        children = os.listdir(root)
    except NotADirectoryError:
        raise _Unsupported(root) from None
    except OSError:
        return []
    found = []
    for child in sorted(children, key=str.lower, reverse=True):
        low = child.lower()
        if low.endswith(_INFO_SUFFIXES):
            found.append((normalize(_name_from_folder(low)), os.path.join(entry, child)))
        elif low.endswith(".egg") and os.path.isdir(os.path.join(root, child)):
            raise _Unsupported(child)  # an unpacked egg on sys.path: its own layout
    _folders_cache[root] = (mtime, found)
    return found


def _check_finders() -> None:
    """Only the path finder (or importlib_metadata's, which replaces its search) may supply distributions."""
    from importlib.machinery import PathFinder

    for finder in sys.meta_path:
        if getattr(finder, "find_distributions", None) is None or finder is PathFinder:
            continue
        if getattr(finder, "__module__", "") not in ("importlib_metadata", "importlib.metadata"):
            raise _Unsupported(repr(finder))


def distributions() -> list[Distribution]:
    """Every distribution on ``sys.path``, the first of each name only (as importlib.metadata resolves one)."""
    try:
        _check_finders()
        seen: set[str] = set()
        found = []
        for entry in sys.path:
            for name, folder in _folders(entry):
                if name not in seen:
                    seen.add(name)
                    found.append(Distribution(folder))
        return found
    except _Unsupported:
        return [_LibraryDistribution(d) for d in _library_distributions()]


def entry_points(group: str) -> list[EntryPoint]:
    """The entry points of ``group`` of every distribution, in the order importlib.metadata gives them."""
    points = []
    for dist in distributions():
        text = dist.read_text("entry_points.txt")
        if not text or f"[{group}]" not in text:
            continue
        section = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line.strip("[]")
            elif section == group:
                name, _, value = line.partition("=")
                points.append(EntryPoint(name.strip(), value.strip(), group, dist))
    return points


def installed(name: str) -> bool:
    """Whether a distribution of this name is installed (its metadata folder is on ``sys.path``)."""
    wanted = normalize(name)
    try:
        _check_finders()
        return any(found == wanted for entry in sys.path for found, _ in _folders(entry))
    except _Unsupported:
        import importlib_metadata

        try:
            importlib_metadata.distribution(name)
        except importlib_metadata.PackageNotFoundError:
            return False
        return True


def _library_distributions() -> list[Any]:
    import importlib_metadata

    seen: set[str] = set()
    unique = []
    for dist in importlib_metadata.distributions():
        key = getattr(dist, "_normalized_name", None) or normalize(dist.name or "")
        if key not in seen:
            seen.add(key)
            unique.append(dist)
    return unique


class _LibraryDistribution(Distribution):
    """A distribution importlib_metadata found, seen through the same interface."""

    __slots__ = ("_dist",)

    def __init__(self, dist: Any) -> None:
        super().__init__(str(getattr(dist, "_path", "")))
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        return self._dist.read_text(filename)

    @property
    def name(self) -> str:
        return self._dist.name

    @property
    def version(self) -> str:
        return self._dist.version
