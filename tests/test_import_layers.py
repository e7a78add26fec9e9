"""The layers of stratagem and of every plugin package: a module imports only its own layer and the layers below
it, and no two modules import each other through any path.

The layers are declared here, once; ``docs/architecture.md`` draws the same table (checked below).

Every run-time import counts, including those inside functions: a lazy import still ties two modules together,
it only hides the tie from the interpreter. An import under ``if TYPE_CHECKING:`` names a type for annotations
and may reach any layer (``hookspecs`` names the ``ClusterEnvironment`` its hooks receive, a mixin names the
class it is mixed into); it ties nothing at run time and counts neither for layers nor for cycles. Importing
``a.b`` loads the package ``a`` too, but that implicit edge is not a dependency of the importer's and is not
counted.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

#: stratagem's layers, bottom first: each entry is a module or a package (with everything inside it). "" is
#: ``stratagem`` itself (its ``__init__``: the public names, imported lazily), which the tools at the top use as
#: a user's script would.
CORE_LAYERS: list[tuple[str, ...]] = [
    ("errors", "hookspecs"),  # the contract: what can go wrong, and every hook
    ("registry",),  # plugin discovery: entry points, names, capabilities, the plugin manager
    ("checkpoint",),  # saving and loading: layouts, atomic publication, object stores, offline tools
    ("launchers",),  # starting, watching and restarting workers; where a process runs
    ("strategies",),  # the strategy bases, precision, manual wrapping
    ("planning",),  # the plan: each strategy set up on a simulated world of fake tensors
    ("engine",),  # the Engine: a strategy's operations for any loop
    ("trainer",),  # the Trainer: the loop, its checks, checkpoints and resume, metrics, progress, events
    ("callbacks", "loggers"),  # the built-in plugins of one Trainer
    ("",),  # the public names: ``import stratagem as sg``
    ("contract",),  # the certification suite and its pytest plugin
    ("cli", "__main__"),  # the commands, compare and demo among them
]

#: Each plugin's layers, bottom first (modules of the package; "" is its ``__init__``).
PLUGIN_LAYERS: dict[str, list[tuple[str, ...]]] = {
    "stratagem_ddp": [("_plugin",), ("_config", "_post_local_sgd"), ("strategy",), ("",)],
    "stratagem_fsdp": [
        ("_plugin", "_pool"),
        ("_policy", "_init"),
        ("_config", "_wrap"),
        ("_mesh",),
        ("strategy",),
        ("",),
    ],
    "stratagem_deepspeed": [
        ("_plugin",),
        ("_options", "_runtime"),
        ("_rules", "_memory"),
        ("_sections",),
        ("_config", "_optimizers"),
        ("_state", "_wrappers", "_offline"),
        ("_checkpoint", "_hf"),
        ("strategy",),
        ("",),
    ],
    "stratagem_ray": [("_plugin",), ("_worker", "_failures", "_cluster"), ("launcher",), ("",)],
    "stratagem_tp": [("_plugin",), ("_styles", "_config"), ("_plan",), ("strategy",), ("",)],
    "stratagem_slurm": [("_plugin",), ("_slurm", "_task"), ("_batch",), ("_follow",), ("launcher",), ("",)],
    "stratagem_pp": [
        ("_plugin",),
        ("_schedules", "_split"),
        ("_config", "_stage"),
        ("_materialize", "_parallelize", "_runtime", "_state"),
        ("strategy",),
        ("",),
    ],
    "stratagem_localsgd": [("strategy",), ("",)],
    "stratagem_subprocess": [("worker",), ("launcher",), ("",)],
}

PACKAGES = [
    "stratagem",
    "stratagem_ddp",
    "stratagem_fsdp",
    "stratagem_deepspeed",
    "stratagem_ray",
    "stratagem_slurm",
    "stratagem_tp",
    "stratagem_localsgd",
    "stratagem_pp",
    "stratagem_subprocess",
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


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The import statements under ``if TYPE_CHECKING:`` (names for annotations only)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                found.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The modules of the package that ``name`` imports: (at run time, for annotations only)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_nodes(tree)
    runtime: set[str] = set()
    annotations: set[str] = set()
    for node in ast.walk(tree):
        targets = annotations if id(node) in typing_only else runtime
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

    def inside(found: set[str]) -> set[str]:
        return {t for t in found if t in known and t != name}

    return inside(runtime), inside(annotations) - inside(runtime)


def _layers(package: str) -> list[tuple[str, ...]]:
    return CORE_LAYERS if package == "stratagem" else PLUGIN_LAYERS[package]


def _layer_index(module: str, package: str, layers: list[tuple[str, ...]]) -> int | None:
    relative = module[len(package) + 1 :] if module != package else ""
    first = relative.split(".")[0]
    for index, members in enumerate(layers):
        if first in members:
            return index
    return None


def _violations(package: str, graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        own = _layer_index(module, package, layers)
        if own is None:
            problems.append(f"{module} is in no layer: add it to the table in {Path(__file__).name}")
            continue
        for target in sorted(targets):
            theirs = _layer_index(target, package, layers)
            if theirs is not None and theirs > own:
                problems.append(
                    f"{module} (layer {own}: {', '.join(layers[own]) or '__init__'}) imports {target}, "
                    f"a layer above it (layer {theirs}: {', '.join(layers[theirs]) or '__init__'})"
                )
    return problems


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
    graph = {name: _imports(name, path, known)[0] for name, path in known.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each group imports itself through the others):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_a_module_imports_only_its_layer_and_those_below(package: str) -> None:
    known = _modules(package)
    graph = {name: _imports(name, path, known)[0] for name, path in known.items()}
    problems = _violations(package, graph, _layers(package))
    assert not problems, "\n".join(problems)


def test_the_checks_find_a_cycle_an_upward_import_and_a_module_in_no_layer() -> None:
    # The checker itself: a graph with a cycle and one without.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    graph = {"stratagem.engine._engine": {"stratagem.trainer._trainer"}, "stratagem.stray": set()}
    problems = _violations("stratagem", graph, _layers("stratagem"))
    assert len(problems) == 2
    engine = next(i for i, layer in enumerate(CORE_LAYERS) if "engine" in layer)
    assert (
        f"stratagem.engine._engine (layer {engine}: engine) imports stratagem.trainer._trainer" in problems[0]
    )
    assert "stratagem.stray is in no layer" in problems[1]
    # Annotations may name a type of any layer; run-time imports may not.
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stratagem.trainer import Trainer\n"
    )
    path = Path(__file__).with_name("_layers_probe.py")
    path.write_text(source)
    try:
        known = {"stratagem.engine.x": path, "stratagem.trainer": path}
        assert _imports("stratagem.engine.x", path, known) == (set(), {"stratagem.trainer"})
    finally:
        path.unlink()


def test_the_architecture_page_draws_the_declared_layers() -> None:
    page = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    diagram = page.split("```text", 1)[1].split("```", 1)[0]
    drawn = [tuple(re.findall(r"stratagem\.(\w+)", line)) for line in diagram.splitlines()]
    drawn = [names for names in drawn if names]
    # The picture names the facade ``stratagem`` itself, and ``python -m stratagem`` beside the CLI.
    expected = [
        tuple("__init__" if n == "" else n for n in layer if n != "__main__") for layer in CORE_LAYERS
    ]
    # The picture has the top layer first.
    assert drawn[::-1] == expected, "docs/architecture.md's diagram differs from CORE_LAYERS"
    top = sorted(p.name.removesuffix(".py") for p in _core_root().iterdir() if not p.name.startswith("__"))
    for name in top:
        if name != "py.typed":
            assert f"stratagem.{name}" in page or f"stratagem/{name}" in page, f"{name} is not described"


def _core_root() -> Path:
    spec = importlib.util.find_spec("stratagem")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def test_the_core_top_level_has_at_most_16_entries_and_no_module_over_400_lines() -> None:
    entries = sorted(p.name for p in _core_root().iterdir() if p.name != "__pycache__")
    # 16 since stratagem.planning (issue 39) joined the packages, one per layer of the table above.
    assert len(entries) <= 16, entries
    too_long = []
    for package in PACKAGES:
        for name, path in _modules(package).items():
            lines = len(path.read_text().splitlines())
            if lines > 400 and name != "stratagem.hookspecs":
                too_long.append(f"{name}: {lines} lines")
    assert not too_long, "split these along their jobs:\n" + "\n".join(too_long)
