"""The core names no plugin package: what to install for a missing name, and what ``strategy="auto"`` picks, come
from what the repository's plugins declare (``register_install_hints``, ``Capabilities(auto_priority=...)``).

Each package of the family names every strategy and launcher of its siblings (checked against what they really
register, so the lists cannot go stale), ``auto`` still means ``ddp`` with several processes, and the core's
code holds no plugin's distribution or package name outside its documentation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

from stratagem import get_registry
from stratagem.registry._manager import discover

ROOT = Path(__file__).resolve().parents[1]


def _family() -> dict[str, tuple[str, str]]:
    """``{distribution: (entry-point name, package)}`` of every package under plugins/."""
    found = {}
    for pyproject in sorted(ROOT.glob("plugins/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        [(entry, target)] = project["entry-points"]["stratagem"].items()
        found[project["name"]] = (entry, target.split(".")[0])
    return found


FAMILY = _family()


def _registered_by(distribution: str) -> set[tuple[str, str]]:
    registry = get_registry()
    names = {
        ("strategy", i.name) for i in registry.strategies.values() if i.plugin.distribution == distribution
    }
    return names | {
        ("launcher", n) for n, i in registry.launchers.items() if i.plugin.distribution == distribution
    }


@pytest.mark.parametrize("distribution", FAMILY)
def test_a_family_package_hints_at_every_name_of_its_siblings(distribution: str) -> None:
    missing = [d for d in FAMILY if not _registered_by(d)]
    if missing:
        pytest.skip(f"not installed: {missing}")
    entry, _package = FAMILY[distribution]
    alone, _ = discover(environ={"STRATAGEM_PLUGINS": entry})
    declared = {key: [h.distribution for h in hints] for key, hints in alone.hints.by_name.items()}
    expected = {
        key: [sibling] for sibling in FAMILY if sibling != distribution for key in _registered_by(sibling)
    }
    assert declared == expected, (
        f"{distribution}'s register_install_hints: missing {sorted(set(expected) - set(declared))}, "
        f"not registered by a sibling {sorted(set(declared) - set(expected))}"
    )


def test_with_one_package_of_the_family_the_others_are_named() -> None:
    if "stratagem-slurm" not in FAMILY or not _registered_by("stratagem-slurm"):
        pytest.skip("stratagem-slurm is not installed")
    registry, _ = discover(environ={"STRATAGEM_PLUGINS": FAMILY["stratagem-slurm"][0]})
    with pytest.raises(KeyError, match=r"It comes with stratagem-ray: pip install stratagem-ray\."):
        registry.get_launcher("ray")
    with pytest.raises(Exception, match=r"Install a strategy plugin: stratagem-ddp, stratagem-deepspeed"):
        registry.auto(world_size=2, accelerator="cpu")


def test_auto_means_ddp_with_several_processes() -> None:
    if not _registered_by("stratagem-ddp"):
        pytest.skip("stratagem-ddp is not installed")
    registry = get_registry()
    for precision in ("32-true", "bf16-mixed"):
        assert registry.auto(world_size=2, accelerator="cpu", precision=precision).name == "ddp"
    candidates = sorted(i.name for i in registry if i.capabilities.auto_priority is not None)
    # fsdp offers itself too, below ddp: a Trainer's plan takes it where ddp does not fit (docs/planning.md).
    assert candidates == (["ddp", "fsdp"] if _registered_by("stratagem-fsdp") else ["ddp"]), candidates
    # What a user meets: an Engine (and so a Trainer) that wants two processes, before anything starts.
    from stratagem import Engine

    assert Engine(strategy="auto", accelerator="cpu", devices=2).strategy_name == "ddp"
    assert Engine(strategy="auto", accelerator="cpu", devices=1).strategy_name == "single_device"


def _names_in_code(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of the string constants and imported modules of ``source``, docstrings left out."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
    return sorted(found)


def plugin_names_in_core(files: dict[str, str]) -> list[str]:
    """Where the code of ``files`` (``{path: source}``) names a plugin's distribution or package."""
    names = [*FAMILY, *(package for _entry, package in FAMILY.values())]
    return [
        f"{path}:{line}: {name!r} in {text!r}"
        for path, source in files.items()
        for line, text in _names_in_code(source)
        for name in names
        if name in text
    ]


def test_the_core_code_names_no_plugin_package() -> None:
    core = ROOT / "core" / "src" / "stratagem"
    files = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(core.rglob("*.py"))}
    assert len(files) > 100 and len(FAMILY) >= 7
    assert plugin_names_in_core(files) == []
    # What the check finds: a package named in a message, an import; not a docstring's example.
    planted = '"""Example: ``pip install stratagem-ray``."""\nHINT = "pip install stratagem-ray"\nimport stratagem_ddp\n'
    assert plugin_names_in_core({"x.py": planted}) == [
        "x.py:2: 'stratagem-ray' in 'pip install stratagem-ray'",
        "x.py:3: 'stratagem_ddp' in 'stratagem_ddp'",
    ]
