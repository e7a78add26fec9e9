"""The Python API pages of the reference, generated from the code by static analysis (Griffe).

What is public is what the code says: ``stratagem.__all__``, the ``__all__`` of each package of the core (and
of its public modules that declare one), and each plugin package's ``__all__``. Each name is placed on the page
of the core package it lives in (``stratagem.Trainer`` lives in ``stratagem.trainer``), so a name added
anywhere appears on its page without an edit here; a page's title is the only thing chosen by hand.
"""

from __future__ import annotations

from pathlib import Path

import griffe
from griffe_stratagem import StratagemDocstrings

#: Titles and order of the core's pages; a package missing here still gets a page, titled by its name.
CORE_PAGES = {
    "trainer": "Trainer and Module",
    "engine": "Engine",
    "strategies": "Strategies",
    "registry": "Registry and capabilities",
    "launchers": "Launchers",
    "checkpoint": "Checkpoints",
    "callbacks": "Callbacks",
    "loggers": "Loggers",
    "errors": "Errors",
}
#: Core packages with a reference of their own: the hook specs' page and the CLI's page; the contract suite is
#: a pytest plugin, documented in docs/plugin-authors.md.
NOT_API = ("hookspecs", "cli", "contract")


class UndocumentableError(Exception):
    """The code cannot be documented as it stands (the message says what to change)."""


def source_paths(root: Path) -> list[Path]:
    return [root / "core" / "src", *sorted(root.glob("plugins/*/src"))]


def plugin_packages(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("plugins/*/src/*/__init__.py"))


def load(root: Path) -> griffe.GriffeLoader:
    loader = griffe.GriffeLoader(
        search_paths=[str(p) for p in source_paths(root)],
        allow_inspection=False,
        docstring_parser=griffe.Parser.sphinx,
        extensions=griffe.load_extensions(StratagemDocstrings),
    )
    for package in ["stratagem", *plugin_packages(root)]:
        loader.load(package)
    loader.resolve_aliases(implicit=False, external=False)
    return loader


def resolve(module: griffe.Module, name: str) -> griffe.Object:
    try:
        member = module[name]
        return member.final_target if member.is_alias else member
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError) as error:
        raise UndocumentableError(
            f"{module.path}.__all__ names {name!r}, which static analysis cannot find ({error!r}). Import it in "
            f"{module.filepath} (under `if TYPE_CHECKING:` when it loads lazily), so readers and type checkers "
            f"see where it comes from."
        ) from error


def public_names(module: griffe.Module) -> list[str]:
    """``__all__``; for a module without one, what it defines under a public name."""
    if module.exports is not None:
        return [str(name) for name in module.exports]
    return [
        name
        for name, member in module.members.items()
        if not name.startswith("_") and not member.is_alias and not member.is_module
    ]


def summary(obj: griffe.Object) -> str:
    text = obj.docstring.value.strip().split("\n\n")[0] if obj.docstring else ""
    return " ".join(text.split()).replace("|", "\\|")


def core_sections(loader: griffe.GriffeLoader) -> dict[str, list[tuple[str, griffe.Object]]]:
    """``{package: [(public path, object), ...]}``: every public name of the core, once, under its package."""
    root = loader.modules_collection["stratagem"]
    sections: dict[str, list[tuple[str, griffe.Object]]] = {}
    seen: set[str] = set()

    def add(public_path: str, obj: griffe.Object) -> None:
        if obj.path in seen:  # already documented under a shorter public path
            return
        seen.add(obj.path)
        package = obj.path.split(".")[1] if obj.path.count(".") >= 1 else obj.path
        sections.setdefault(package, []).append((public_path, obj))

    for name in public_names(root):
        add(f"stratagem.{name}", resolve(root, name))
    for package_name, package in root.members.items():
        if (
            package_name.startswith("_")
            or package.is_alias
            or not package.is_module
            or package_name in NOT_API
        ):
            continue
        for name in public_names(package):
            add(f"{package.path}.{name}", resolve(package, name))
        for module_name, module in package.members.items():
            if (
                module_name.startswith("_")
                or module.is_alias
                or not module.is_module
                or module.exports is None
            ):
                continue
            for name in public_names(module):
                add(f"{module.path}.{name}", resolve(module, name))
    return sections


def directive(identifier: str, heading_level: int = 2, **options: object) -> str:
    lines = [f"::: {identifier}", "    options:", f"      heading_level: {heading_level}"]
    lines += [f"      {key}: {value}" for key, value in options.items()]
    return "\n".join(lines) + "\n"


def module_docstring(identifier: str) -> str:
    return directive(identifier, show_root_heading="false", show_root_toc_entry="false", members="false")


def core_page(package: str, entries: list[tuple[str, griffe.Object]], extra: str = "") -> str:
    title = CORE_PAGES.get(package, f"stratagem.{package}")
    parts = [f"# {title}\n", module_docstring(f"stratagem.{package}")]
    by_module: dict[str, list[str]] = {}
    for public_path, _obj in entries:
        by_module.setdefault(public_path.rsplit(".", 1)[0], []).append(public_path)
    for module, paths in by_module.items():
        if module not in ("stratagem", f"stratagem.{package}"):
            # A public module of its own (stratagem.checkpoint.layouts): a section, its names one level down.
            parts += [f"## `{module}`\n", module_docstring(module)]
            parts += [directive(path, heading_level=3) for path in paths]
        else:
            parts += [directive(path) for path in paths]
    if extra:
        parts.append(extra)
    return "\n".join(parts)


def index_page(
    sections: dict[str, list[tuple[str, griffe.Object]]], other_pages: list[tuple[str, str]]
) -> str:
    lines = [
        "# Reference",
        "",
        "Generated from the code when the site is built: the names each package declares public (`__all__`), "
        "their signatures and docstrings, the hook specs, the command line's parsers and each plugin's "
        "registrations. Nothing here is written by hand.",
        "",
    ]
    for package in ordered(sections):
        lines += [
            f"## [{CORE_PAGES.get(package, package)}]({package}.md)",
            "",
            "| name | what it is |",
            "| --- | --- |",
        ]
        lines += [f"| [`{path}`][{path}] | {summary(obj)} |" for path, obj in sections[package]]
        lines.append("")
    lines += ["## More", ""]
    lines += [f"- [{title}]({uri})" for title, uri in other_pages]
    return "\n".join(lines) + "\n"


def ordered(sections: dict[str, object]) -> list[str]:
    known = [p for p in CORE_PAGES if p in sections]
    return known + sorted(p for p in sections if p not in CORE_PAGES)
