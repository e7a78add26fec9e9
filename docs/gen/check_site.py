"""Is every public name and every hook spec documented in a BUILT site? ``python docs/gen/check_site.py SITE``
prints what is missing and exits 1 if anything is (tests/test_docs.py runs it on every build).

It knows nothing of the generators: what must be documented comes from the importable code (``__all__`` of
``stratagem``, of the modules that hold the plugin author's API (:data:`PLUGIN_API`), of ``stratagem.callbacks``
and ``stratagem.loggers``, and of every plugin package under plugins/, and every function pluggy knows as a hook
spec of ``stratagem.hookspecs``); what is documented comes from the
site's ``objects.inv`` (where each name's entry is) and its HTML (what that entry says). An entry counts only
with a docstring, and a hook spec's entry only if it also shows each of the spec's arguments.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
# Parts of an entry that are not its documentation: the bases line, the labels, and its members.
_NOT_DOCSTRING = {"doc-class-bases", "doc-children", "doc-labels"}


def plugin_packages(root: Path = ROOT) -> list[str]:
    return sorted(p.parent.name for p in root.glob("plugins/*/src/*/__init__.py"))


#: The public modules a plugin imports from (docs/plugin-authors.md, "The plugin API"): each name of their
#: ``__all__`` must have an entry, at that path or as an alias of the one where it is documented.
PLUGIN_API = [
    "stratagem.strategies",
    "stratagem.strategies.compiling",
    "stratagem.launchers",
    "stratagem.checkpoint",
    "stratagem.checkpoint.layouts",
    "stratagem.registry",
]


def public_names(root: Path = ROOT) -> list[str]:
    """The full paths of the names that must have an entry."""
    names = []
    modules = ["stratagem", *PLUGIN_API, "stratagem.callbacks", "stratagem.loggers", *plugin_packages(root)]
    for module_name in modules:
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{name}" for name in module.__all__]
    return names


def hook_specs() -> dict[str, list[str]]:
    """``{"stratagem.hookspecs.NAME": [argument, ...]}`` of every hook spec, as pluggy sees them."""
    hookspecs = importlib.import_module("stratagem.hookspecs")
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return {
        f"stratagem.hookspecs.{name}": list(inspect.signature(function).parameters)
        for name, function in vars(hookspecs).items()
        if callable(function) and hasattr(function, marker)
    }


def inventory(site: Path) -> dict[str, str]:
    """``{name: "page/#anchor"}`` from the site's ``objects.inv`` (Sphinx's inventory format, version 2)."""
    header, _, body = (site / "objects.inv").read_bytes().partition(b"compressed using zlib.\n")
    if not header.startswith(b"# Sphinx inventory version 2"):
        raise ValueError(f"{site / 'objects.inv'} is not a version 2 inventory")
    found: dict[str, str] = {}
    for line in zlib.decompress(body).decode().splitlines():
        name, _domain_role, priority, uri, _shown = line.split(" ", 4)
        uri = uri[:-1] + name if uri.endswith("$") else uri
        # A primary entry (priority 1) wins over the same name as an alias of something else.
        if name not in found or priority == "1":
            found[name] = uri
    return found


class _Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: _Element | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[_Element | str] = []

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self, skip: set[str] = frozenset()) -> str:  # type: ignore[assignment]
        return "".join(
            child if isinstance(child, str) else ("" if child.classes & skip else child.text(skip))
            for child in self.children
        )


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = _Element("root", {}, None)
        self.current = self.root
        self.ids: dict[str, _Element] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = _Element(tag, {k: v or "" for k, v in attrs}, self.current)
        self.current.children.append(element)
        if "id" in element.attrs:
            self.ids.setdefault(element.attrs["id"], element)
        if tag not in _VOID:
            self.current = element

    def handle_endtag(self, tag: str) -> None:
        element = self.current
        while element.parent is not None and element.tag != tag:
            element = element.parent
        if element.parent is not None:
            self.current = element.parent

    def handle_data(self, data: str) -> None:
        self.current.children.append(data)


class Site:
    def __init__(self, site: Path) -> None:
        self.site = site
        self.entries = inventory(site)
        self._pages: dict[str, _Tree] = {}

    def _page(self, page: str) -> _Tree:
        if page not in self._pages:
            tree = _Tree()
            path = self.site / page if page.endswith(".html") else self.site / page / "index.html"
            tree.feed(path.read_text())
            self._pages[page] = tree
        return self._pages[page]

    def entry(self, name: str) -> tuple[str, str] | None:
        """``(documentation, signature)`` text of ``name``'s entry, or ``None`` if it has none."""
        if name not in self.entries:
            return None
        page, _, anchor = self.entries[name].partition("#")
        heading = self._page(page.rstrip("/")).ids.get(anchor)
        if heading is None or heading.parent is None:
            return None
        block = heading.parent  # the div.doc-object holding the heading, the signature and the contents
        parts = [c for c in block.children if isinstance(c, _Element)]
        contents = next((c for c in parts if "doc-contents" in c.classes), None)
        signature = next((c for c in parts if "doc-signature" in c.classes), None)
        if contents is None:
            return None
        return " ".join(contents.text(_NOT_DOCSTRING).split()), signature.text() if signature else ""


def missing(site: Path, root: Path = ROOT) -> list[str]:
    """What is not documented in the built ``site``, one line each (empty: everything is)."""
    built = Site(site)
    problems = []
    for name in public_names(root):
        found = built.entry(name)
        if found is None:
            problems.append(f"{name}: no entry in the reference")
        elif not found[0]:
            problems.append(f"{name}: its entry has no docstring")
    for name, arguments in hook_specs().items():
        found = built.entry(name)
        if found is None:
            problems.append(f"{name}: hook spec with no entry in the reference")
        elif not found[0]:
            problems.append(f"{name}: hook spec whose entry has no docstring")
        else:
            shown = set(re.findall(r"(\w+)\s*:", found[1].split("(", 1)[-1]))
            absent = [a for a in arguments if a not in shown]
            if absent:
                problems.append(f"{name}: hook spec whose entry does not show its arguments {absent}")
    return problems


if __name__ == "__main__":
    problems = missing(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "site"))
    print("\n".join(problems) or "every public name and hook spec is documented")
    sys.exit(1 if problems else 0)
