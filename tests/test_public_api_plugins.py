"""Plugins are written against stratagem's public API alone: no plugin package of this repository (every folder
under plugins/ and examples/, its sources and its own tests), and no package ``stratagem new`` generates (each
kind), imports a private name of ``stratagem``.

A name is private when a component of its dotted path below ``stratagem`` starts with ``_`` (dunders aside):
``stratagem.launchers._worker_start``, ``from stratagem.strategies import _regions``, ``stratagem._x``. Found
statically, wherever they are: imports at run time and under ``if TYPE_CHECKING:``, ``import_module`` strings
and ``"module:Class"`` factory strings, attributes reached through an imported module
(``sg.registry._manager``), and the code in strings that tests hand to ``python -c``. A failure names the file,
the line, the private name, and the public name holding the same object when there is one.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Every plugin package of the repository: a folder with a pyproject.toml under plugins/ or examples/.
PACKAGES = sorted(
    p.parent for p in [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]
)
#: What ``stratagem new`` generates, one package of each kind: (kind, name, --based-on).
GENERATED = [
    ("strategy", "zz_api_plain", None),
    ("strategy", "zz_api_based", "single_device"),
    ("launcher", "zz_api_launcher", None),
    ("callback", "zz_api_callback", None),
    ("logger", "zz_api_logger", None),
]
#: Where the public API is, for the hint: the packages' ``__all__`` and the public modules declaring one.
PUBLIC_MODULES = [
    "stratagem",
    "stratagem.strategies",
    "stratagem.launchers",
    "stratagem.checkpoint",
    "stratagem.registry",
    "stratagem.engine",
    "stratagem.trainer",
    "stratagem.callbacks",
    "stratagem.loggers",
    "stratagem.errors",
    "stratagem.hookspecs",
    "stratagem.strategies.compiling",
    "stratagem.checkpoint.layouts",
]
#: A dotted path alone in a string (an ``import_module`` argument, a ``"module:Class"`` factory).
_DOTTED = re.compile(r"stratagem(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_][\w.]*)?")


def private(dotted: str) -> bool:
    """Whether ``dotted`` (``stratagem.a.b``, or ``stratagem.a:B``) names something private of stratagem."""
    parts = dotted.replace(":", ".").split(".")
    if parts[0] != "stratagem":
        return False
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])


def _attribute_path(node: ast.Attribute, bound: dict[str, str]) -> str | None:
    names = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name) and current.id in bound:
        return ".".join([bound[current.id], *reversed(names)])
    return None


def private_uses(source: str, where: str) -> list[tuple[str, int, str]]:
    """``(where, line, dotted name)`` of every private name of stratagem that ``source`` reaches."""
    tree = ast.parse(source)
    found: list[tuple[str, int, str]] = []
    bound: dict[str, str] = {}  # local name -> the stratagem path it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "stratagem":
                    found += [(where, node.lineno, alias.name)] if private(alias.name) else []
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else "stratagem"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "stratagem":
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    found += [(where, node.lineno, dotted)] if private(dotted) else []
                    bound[alias.asname or alias.name] = dotted
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "stratagem" in node.value:
            text = node.value
            if _DOTTED.fullmatch(text.strip()):
                found += [(where, node.lineno, text.strip())] if private(text.strip()) else []
            elif "import" in text:
                # Code a test runs in another interpreter (``python -c``): its imports count too.
                found += [(where, node.lineno, name) for name in _imports_in_code(text)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            dotted = _attribute_path(node, bound)
            if dotted is not None and private(dotted):
                found.append((where, node.lineno, dotted))
    # An attribute chain is seen at each of its prefixes: keep the shortest private one per line.
    unique: dict[tuple[str, int], list[str]] = {}
    for w, line, name in found:
        names = unique.setdefault((w, line), [])
        if not any(name.startswith(other + ".") or name == other for other in names):
            names[:] = [n for n in names if not n.startswith(name + ".")] + [name]
    return [(w, line, name) for (w, line), names in sorted(unique.items()) for name in names]


def _imports_in_code(text: str) -> list[str]:
    """The private names of stratagem that the code in a string imports; line by line when the string is a
    piece of a program (concatenated with others) rather than a whole one."""
    try:
        return [name for _w, _line, name in private_uses(textwrap.dedent(text), "")]
    except SyntaxError:
        pass
    found = []
    for line in text.splitlines():
        for statement in line.split(";"):
            if re.match(r"\s*(from|import)\s+stratagem\b", statement):
                try:
                    found += [name for _w, _line, name in private_uses(statement.strip(), "")]
                except SyntaxError:
                    continue
    return found


def scan(folder: Path) -> list[tuple[str, int, str]]:
    """Every private use of stratagem in the Python files of the package folder ``folder``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if {"build", "__pycache__"} & set(path.parts) or any(p.endswith(".egg-info") for p in path.parts):
            continue
        found += private_uses(path.read_text(), str(path.relative_to(folder.parent)))
    return found


def public_home(dotted: str) -> str | None:
    """The public name of the object ``dotted`` names, if it has one."""
    module_path, _, attribute = dotted.replace(":", ".").rpartition(".")
    try:
        target = getattr(importlib.import_module(module_path), attribute)
    except (ImportError, AttributeError):
        try:
            target = importlib.import_module(dotted.replace(":", "."))
        except ImportError:
            return None
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for exported in getattr(module, "__all__", []):
            if getattr(module, exported, None) is target:
                return f"{name}.{exported}"
    return None


def explain(found: list[tuple[str, int, str]]) -> str:
    lines = []
    for where, line, name in found:
        home = public_home(name)
        use = f"use {home}" if home else "no public name holds it: see 'Stability' in docs/plugin-authors.md"
        lines.append(f"{where}:{line}: {name} is private to stratagem; {use}")
    return "\n".join(lines)


@pytest.mark.parametrize("folder", PACKAGES, ids=[f"{p.parent.name}/{p.name}" for p in PACKAGES])
def test_a_repository_plugin_imports_only_public_names(folder: Path) -> None:
    found = scan(folder)
    assert not found, "\n" + explain(found)


def test_every_plugin_package_is_scanned() -> None:
    names = {p.name for p in PACKAGES}
    assert {"ddp", "fsdp", "tp", "pp", "deepspeed_stub", "ray", "slurm", "third_party_strategy"} <= names, (
        names
    )


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One package of each kind ``stratagem new`` writes, written to a folder (not installed)."""
    from stratagem.cli.new._package import generate

    where = tmp_path_factory.mktemp("generated")
    for kind, name, based_on in GENERATED:
        for relative, text in generate(kind, name, based_on).items():
            path = where / name / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return where


@pytest.mark.parametrize(("kind", "name", "based_on"), GENERATED, ids=[g[1] for g in GENERATED])
def test_a_generated_plugin_imports_only_public_names(
    generated: Path, kind: str, name: str, based_on: str | None
) -> None:
    folder = generated / name
    module = folder / "src" / f"stratagem_{name}" / f"{kind}.py"
    # The check is only as good as what it reads: the class, its hooks, and its imports of stratagem.
    assert "from stratagem" in module.read_text() and "@hookimpl" in module.read_text(), module
    found = scan(folder)
    assert not found, "\n" + explain(found)


#: Ways to reach a private name, each as a line added to a copy of a real plugin (stratagem-ray's launcher).
MUTATIONS = {
    "from-import at run time": (
        "def _f():\n    from stratagem.launchers._worker_start import free_port\n",
        "stratagem.launchers._worker_start.free_port",
    ),
    "import under TYPE_CHECKING": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import stratagem.registry._manager\n",
        "stratagem.registry._manager",
    ),
    "a private module from a package": (
        "from stratagem.strategies import _regions\n",
        "stratagem.strategies._regions",
    ),
    "a private attribute of stratagem": (
        "from stratagem import _LAZY\n",
        "stratagem._LAZY",
    ),
    "import_module of a string": (
        "import importlib\n_m = importlib.import_module('stratagem.launchers._elastic_agent')\n",
        "stratagem.launchers._elastic_agent",
    ),
    "an attribute of an imported module": (
        "import stratagem.launchers as launchers\n_g = launchers._failure_records.LOST_PEER_GRACE_S\n",
        "stratagem.launchers._failure_records",
    ),
    "code run by python -c": (
        "_CODE = 'import json; from stratagem.registry._manager import get_registry; print(1)'\n",
        "stratagem.registry._manager.get_registry",
    ),
    "a piece of a program in a string": (
        "_CODE = ')\\nimport stratagem.launchers._rerun as r\\nprint(r'\n",
        "stratagem.launchers._rerun",
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_check_fails_on_a_copy_of_a_plugin_that_imports_a_private_name(
    tmp_path: Path, mutation: str
) -> None:
    copy = tmp_path / "ray"
    shutil.copytree(
        ROOT / "plugins" / "ray", copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    assert scan(copy) == []
    added, name = MUTATIONS[mutation]
    launcher = copy / "src" / "stratagem_ray" / "launcher.py"
    lines = launcher.read_text().splitlines(keepends=True)
    launcher.write_text("".join(lines) + "\n\n" + added)
    found = scan(copy)
    assert [(where, found_name) for where, _line, found_name in found] == [
        ("ray/src/stratagem_ray/launcher.py", name)
    ], found
    assert f"{name} is private to stratagem" in explain(found)


def test_the_message_names_the_public_name_of_the_same_object() -> None:
    found = private_uses("from stratagem.registry._manager import get_registry\n", "plugin.py")
    assert explain(found) == (
        "plugin.py:1: stratagem.registry._manager.get_registry is private to stratagem; use stratagem.get_registry"
    )
