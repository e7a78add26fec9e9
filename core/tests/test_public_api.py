"""Every name the documentation shows imports: ``from stratagem... import ...`` lines in its code blocks and the
dotted ``stratagem.*`` names in its text (README.md, docs/, each plugin's README). Moving a module means
changing the pages that show it."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("plugins/*/README.md"))]
PAGES += sorted(ROOT.glob("examples/*/README.md"))
#: Dotted names in prose that are not Python names (files, commands, options).
NOT_NAMES = {"stratagem.json"}


def _code_imports(text: str) -> set[tuple[str, str | None]]:
    found: set[tuple[str, str | None]] = set()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stratagem"):
                found.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update((a.name, None) for a in node.names if a.name.startswith("stratagem"))
    return found


def _dotted_names(text: str) -> set[str]:
    names = set(re.findall(r"\bstratagem(?:_[a-z]+)?(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text))
    return {n.rstrip(".") for n in names} - NOT_NAMES


def _resolve(dotted: str) -> object:
    """A module, or an attribute of the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(dotted)


def _documented() -> list[str]:
    names: set[str] = set()
    for page in PAGES:
        text = page.read_text()
        for module, name in _code_imports(text):
            names.add(module if name is None else f"{module}.{name}")
        names |= _dotted_names(text)
    return sorted(names)


def test_the_pages_show_the_main_names() -> None:
    documented = _documented()
    # The scan itself finds the names a user meets first.
    for expected in ("stratagem.callbacks.EarlyStopping", "stratagem.contract", "stratagem.wrap"):
        assert expected in documented


@pytest.mark.parametrize("name", _documented())
def test_a_documented_name_imports(name: str) -> None:
    _resolve(name)
