"""The documentation site (mkdocs.yml, docs/gen/): it builds with ``--strict``, and its reference documents every
public name, every hook spec, every command and flag, and every registered strategy. The browser's view of it is
tests/test_docs_browser.py."""

from __future__ import annotations

import argparse
import ast
import importlib
import itertools
import re
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly_with_pages_at_their_repository_paths(built_site: Path) -> None:
    # The build itself (the fixture) fails on any warning; here, that the pages are where links expect them.
    for page in [
        "index.html",
        "docs/architecture/index.html",
        "plugins/fsdp/index.html",
        "reference/hooks/index.html",
    ]:
        assert (built_site / page).is_file(), page
    home = (built_site / "index.html").read_text()
    # README.md links to docs/*.md and plugins/*/README.md by their paths; on the site they are its pages.
    assert 'href="docs/architecture/"' in home and 'href="plugins/slurm/"' in home


def test_every_public_name_and_hook_spec_has_a_documented_entry(
    built_site: Path, check_site: ModuleType
) -> None:
    names = check_site.public_names()
    specs = check_site.hook_specs()
    # The check is only as good as what it expects: every plugin package, and the hooks with their arguments.
    assert {
        "stratagem_ddp",
        "stratagem_fsdp",
        "stratagem_deepspeed",
        "stratagem_tp",
        "stratagem_ray",
        "stratagem_slurm",
        "stratagem_pp",
    } <= set(check_site.plugin_packages())
    assert {"stratagem.Trainer", "stratagem.callbacks.EarlyStopping", "stratagem_fsdp.FSDPStrategy"} <= set(
        names
    )
    assert specs["stratagem.hookspecs.wrap_model"] == ["model"] and len(specs) >= 30
    assert check_site.missing(built_site) == []


def _remove(path: Path, find: type, name: str, docstring_only: bool) -> None:
    """Delete the definition ``name`` (or only its docstring) from the source file ``path``."""
    source = path.read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, find) and n.name == name)
    start, end = (
        (node.body[0].lineno, node.body[0].end_lineno)
        if docstring_only
        else (
            node.decorator_list[0].lineno if node.decorator_list else node.lineno,
            node.end_lineno,
        )
    )
    lines = source.splitlines(keepends=True)
    path.write_text("".join(lines[: start - 1] + lines[end:]))  # type: ignore[operator]


def _copy_checkout(to: Path) -> None:
    """What the site is built from: its config and generators, the Markdown, and the packages' sources."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "tests")
    for name in ["mkdocs.yml", "README.md", "benchmarks/README.md"]:
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, to / name)
    shutil.copytree(ROOT / "docs", to / "docs", ignore=skip)
    shutil.copytree(ROOT / "core" / "src", to / "core" / "src", ignore=skip)
    for folder in [*ROOT.glob("plugins/*"), *ROOT.glob("examples/*")]:
        for part in ["README.md", "pyproject.toml", "src"]:
            if (folder / part).is_dir():
                shutil.copytree(folder / part, to / folder.relative_to(ROOT) / part, ignore=skip)
            elif (folder / part).is_file():
                (to / folder.relative_to(ROOT)).mkdir(parents=True, exist_ok=True)
                shutil.copy2(folder / part, to / folder.relative_to(ROOT) / part)


def test_the_check_fails_when_a_public_name_loses_its_docstring_or_a_hook_spec_its_entry(
    tmp_path: Path, check_site: ModuleType, build_docs: Any
) -> None:
    # The same checkout with Engine's docstring deleted and the wrap_model spec gone from hookspecs.py, so from
    # the generated hook page. The site still builds (nothing refers to either by link), and the check, which
    # takes what must be documented from the real code, names exactly those two.
    checkout = tmp_path / "checkout"
    _copy_checkout(checkout)
    _remove(checkout / "core/src/stratagem/engine/_engine.py", ast.ClassDef, "Engine", docstring_only=True)
    _remove(checkout / "core/src/stratagem/hookspecs.py", ast.FunctionDef, "wrap_model", docstring_only=False)
    build_docs(checkout, tmp_path / "site")
    assert check_site.missing(tmp_path / "site") == [
        "stratagem.Engine: its entry has no docstring",
        "stratagem.hookspecs.wrap_model: hook spec with no entry in the reference",
    ]


def _commands(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{path} {name}")
    return found


def test_the_cli_page_has_every_command_and_every_flag(built_site: Path) -> None:
    cli = importlib.import_module("stratagem.cli")
    cli._load_extensions()
    page = (built_site / "reference" / "cli" / "index.html").read_text()
    commands = _commands(cli.build_parser(), "stratagem")[1:]
    assert len(commands) >= 8
    for path, parser in commands:
        assert f'id="{path.replace(" ", "-")}"' in page, f"no section for `{path}`"
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"<code>{flag}</code>" in page, f"`{path} {flag}` is not on the CLI page"


def test_every_registered_strategy_and_launcher_is_on_its_package_page(built_site: Path) -> None:
    import tomllib

    from stratagem.registry._manager import discover

    registry, _ = discover()
    pages = {"stratagem": (built_site / "reference/strategies/index.html").read_text()}
    pages["stratagem"] += (built_site / "reference/launchers/index.html").read_text()
    for pyproject in ROOT.glob("plugins/*/pyproject.toml"):
        distribution = tomllib.loads(pyproject.read_text())["project"]["name"]
        package = next(p.parent.name for p in pyproject.parent.glob("src/*/__init__.py"))
        pages[distribution] = (built_site / "reference/plugins" / package / "index.html").read_text()
    registered = [*registry.strategies.values(), *registry.launchers.values()]
    checked = [info for info in registered if info.plugin.distribution in pages]
    assert {"single_device", "fsdp", "hsdp", "ddp", "deepspeed_stage_3", "tp", "pp", "elastic"} <= {
        i.name for i in checked
    }
    for info in checked:
        assert f"<code>{info.name}</code>" in pages[info.plugin.distribution], info.name


@pytest.mark.parametrize("package", ["stratagem_fsdp", "stratagem_ddp"])
def test_a_strategys_options_are_shown_with_their_defaults(
    built_site: Path, check_site: ModuleType, package: str
) -> None:
    # The options are an attrs class; its __init__ exists only at run time, so the site's Griffe extension
    # writes it from the fields. Its signature must show each option with its default.
    import attrs

    module = importlib.import_module(package)
    config = next(getattr(module, n) for n in module.__all__ if n.endswith("Config"))
    entry = check_site.Site(built_site).entry(f"{package}.{config.__name__}")
    assert entry is not None
    lines = [line.strip() for line in entry[1].replace("'", '"').splitlines()]
    for field in attrs.fields(config):
        if field.init and not isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            default = repr(field.default).replace("'", '"')
            shown = [line for line in lines if re.match(rf"{field.alias}\b", line)]
            assert shown and shown[0].endswith(f"= {default},"), (field.alias, default, shown)


def test_the_hook_page_groups_the_specs_as_hookspecs_py_does(
    built_site: Path, check_site: ModuleType
) -> None:
    source = (ROOT / "core/src/stratagem/hookspecs.py").read_text().splitlines()
    dashes = [i for i, line in enumerate(source) if re.fullmatch(r"#\s*-{10,}\s*", line)]
    # A banner's title is the comment line between a pair of dash lines (up to a colon).
    titles = [source[i + 1].lstrip("# ").split(":")[0] for i, j in itertools.pairwise(dashes) if j == i + 2]
    tree = check_site._Tree()
    tree.feed((built_site / "reference/hooks/index.html").read_text())
    article = next(e for e in _walk(tree.root) if e.tag == "article")
    groups: list[tuple[str, list[str]]] = []
    for element in _walk(article):
        if element.tag == "h2":
            groups.append((element.text().strip(" ¶\n").lower(), []))
        elif element.tag == "h3" and element.attrs.get("id", "").startswith("stratagem.hookspecs."):
            groups[-1][1].append(element.attrs["id"].rsplit(".", 1)[-1])
    assert [title for title, _ in groups] == ["markers", *(t.lower() for t in titles)]
    placed = {hook: title for title, hooks in groups for hook in hooks}
    assert placed["wrap_model"] == "model" and placed["on_fit_start"] == "trainer events"
    assert set(placed) == {name.rsplit(".", 1)[-1] for name in check_site.hook_specs()}


def _walk(element: Any) -> Any:
    for child in element.children:
        if not isinstance(child, str):
            yield child
            yield from _walk(child)
