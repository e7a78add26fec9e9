"""No import cycle between the modules of stratagem or of any plugin: a layer imports only layers below it.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import still ties
two modules together, it only hides the tie from the interpreter. Importing ``a.b`` loads the package ``a``
too, but that implicit edge is not a dependency of the importer's and is not counted.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGES = [
    "stratagem",
    "stratagem_ddp",
    "stratagem_fsdp",
    "stratagem_deepspeed",
    "stratagem_ray",
    "stratagem_slurm",
    "stratagem_tp",
    "stratagem_localsgd",
]


def _modules(package: str) -> dict[str, Path]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from pkg import mod` depends on the submodule; `from pkg import name` on the package.
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return {t for t in targets if t in known and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    known = _modules(package)
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each group imports itself through the others):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_walk_finds_a_cycle() -> None:
    # The checker itself: a graph with a cycle and one without.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
