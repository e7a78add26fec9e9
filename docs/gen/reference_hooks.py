"""The hook specs' page, generated from ``stratagem/hookspecs.py``: every function decorated with ``@hookspec``,
grouped under the module's banner comments, in the module's order.

A banner is a run of comment lines between two lines of dashes; its first line is the group's title (the text
after a colon reads as its description), and comment lines right after the closing dashes describe it further.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from reference_api import directive, module_docstring

_DASHES = re.compile(r"^#\s*-{10,}\s*$")
_COMMENT = re.compile(r"^#\s?(.*)$")


def banners(source: str) -> list[tuple[int, str, str]]:
    """``[(line, title, description), ...]`` of the banner comments, 1-based lines."""
    lines = source.splitlines()
    found = []
    i = 0
    while i < len(lines):
        if _DASHES.match(lines[i]):
            j = i + 1
            text = []
            while j < len(lines) and not _DASHES.match(lines[j]) and _COMMENT.match(lines[j]):
                text.append(_COMMENT.match(lines[j]).group(1).strip())  # type: ignore[union-attr]
                j += 1
            if text and j < len(lines) and _DASHES.match(lines[j]):
                k = j + 1
                while k < len(lines) and _COMMENT.match(lines[k]) and not _DASHES.match(lines[k]):
                    text.append(_COMMENT.match(lines[k]).group(1).strip())  # type: ignore[union-attr]
                    k += 1
                title, _, rest = text[0].partition(":")
                description = " ".join([rest.strip(), *text[1:]]).strip()
                found.append((i + 1, title.strip(), description))
                i = k
                continue
        i += 1
    return found


def _is_hookspec(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "hookspec") or (
        isinstance(target, ast.Attribute) and target.attr == "hookspec"
    )


def hookspecs(source: str) -> list[tuple[int, str]]:
    """``[(line, name), ...]`` of the functions decorated with ``@hookspec``, in the module's order."""
    tree = ast.parse(source)
    return [
        (min(d.lineno for d in node.decorator_list), node.name)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any(_is_hookspec(d) for d in node.decorator_list)
    ]


def grouped(source: str) -> list[tuple[str, str, list[str]]]:
    """``[(title, description, [hook, ...]), ...]``; hooks above the first banner form a group of their own."""
    groups: list[tuple[str, str, list[str]]] = [("Hooks", "", [])]
    marks = banners(source)
    for line, name in hookspecs(source):
        while marks and marks[0][0] < line:
            _, title, description = marks.pop(0)
            groups.append((title[:1].upper() + title[1:], description, []))
        groups[-1][2].append(name)
    return [group for group in groups if group[2]]


def hooks_page(hookspecs_file: Path, markers: list[str]) -> str:
    source = hookspecs_file.read_text()
    parts = [
        "# Hook specs\n",
        "Every hook of `stratagem.hookspecs`, grouped and ordered as in the module, generated from it when the "
        "site is built. Labels show the spec's pluggy options: `firstresult` means the first non-`None` "
        "result is the answer (the chosen strategy's or launcher's); a hook without it is broadcast, and every "
        "implementation runs. [Hooks, explained](../docs/hooks.md) is the guide: when each hook runs, what the "
        "base classes do, and the order of the Trainer's events.\n",
        module_docstring("stratagem.hookspecs"),
        "## Markers\n",
        "Plugins mark their implementations with `hookimpl`; `hookspec` marks the specs below.\n",
    ]
    parts += [directive(path, heading_level=3) for path in markers]
    for title, description, names in grouped(source):
        parts.append(f"## {title}\n")
        if description:
            parts.append(description[:1].upper() + description[1:] + "\n")
        parts += [
            directive(f"stratagem.hookspecs.{name}", heading_level=3, show_root_full_path="false")
            for name in names
        ]
    return "\n".join(parts)
