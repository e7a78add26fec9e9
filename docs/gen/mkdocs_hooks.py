"""MkDocs hooks (named in mkdocs.yml): lay out the site's pages and generate the reference.

Why hooks rather than a generator plugin such as mkdocs-gen-files: MkDocs' own ``on_config``/``on_files`` and
``File.generated`` do what is needed, with one dependency less and nothing written into the checkout.

The site's pages sit at their repository paths: README.md is ``index.md``, docs/X.md is ``docs/X.md``,
plugins/P/README.md is ``plugins/P/README.md``. A relative link that works on GitHub therefore works on the site,
and ``mkdocs build --strict`` fails on one that works on neither. The reference (``reference/``) is generated
from the checkout being built: Griffe reads its sources, and the command-line parsers and the plugins'
registrations are imported from it (both import nothing heavy), so the build needs no installed stratagem.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import reference_api
import reference_cli
import reference_hooks
import reference_plugins
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

_generated: dict[str, str] = {}


def _root(config: Any) -> Path:
    return Path(config.config_file_path).resolve().parent


def _use_checkout(root: Path) -> None:
    # The checkout's own code first: the build documents the tree it runs in, installed or not.
    for path in reversed(reference_api.source_paths(root)):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def _pages(root: Path) -> tuple[dict[str, str], list[Any]]:
    """``({src_uri: markdown}, nav entries)`` of the reference."""
    loader = reference_api.load(root)
    sections = reference_api.core_sections(loader)
    markers = [path for path, _ in sections.pop("hookspecs", [])]
    core = reference_plugins.core_registrations()
    pages: dict[str, str] = {}
    nav: list[Any] = [{"Overview": "reference/index.md"}]
    for package in reference_api.ordered(sections):
        # The core's own strategies, launchers, callbacks and loggers, on the page of the package of that name.
        extra = reference_plugins.table(package, core[package]) if core.get(package) else ""
        if extra:
            extra = "## Built in, registered by name\n\n" + extra
        pages[f"reference/{package}.md"] = reference_api.core_page(package, sections[package], extra)
        nav.append({reference_api.CORE_PAGES.get(package, package): f"reference/{package}.md"})
    pages["reference/hooks.md"] = reference_hooks.hooks_page(
        root / "core/src/stratagem/hookspecs.py", markers
    )
    pages["reference/cli.md"] = reference_cli.cli_page()
    nav += [{"Hook specs": "reference/hooks.md"}, {"Command line": "reference/cli.md"}]
    plugin_nav = []
    for plugin in reference_plugins.plugins(root):
        uri = f"reference/plugins/{plugin.package}.md"
        pages[uri] = plugin.page(loader, root)
        plugin_nav.append({plugin.package: uri})
    nav.append({"Plugin packages": plugin_nav})
    other = [("Hook specs", "hooks.md"), ("Command line", "cli.md")]
    other += [(next(iter(e)), e[next(iter(e))][len("reference/") :]) for e in plugin_nav]
    pages["reference/index.md"] = reference_api.index_page(sections, other)
    return pages, nav


def _readmes(root: Path) -> list[tuple[str, Path]]:
    """The plugin and example packages' READMEs, by their repository paths."""
    found = sorted(root.glob("plugins/*/README.md")) + sorted(root.glob("examples/*/README.md"))
    return [(p.relative_to(root).as_posix(), p) for p in found]


def _title(readme: Path) -> str:
    first = readme.read_text().splitlines()[0]
    return first.lstrip("#").strip().split(":")[0]


def _listed(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_listed(v) for v in nav.values()))
    if isinstance(nav, list):
        return set().union(*(_listed(v) for v in nav)) if nav else set()
    return set()


def _add_unlisted_guides(nav: list[Any], root: Path) -> None:
    """A docs/*.md that mkdocs.yml does not list yet goes at the end of the guide, titled by its heading."""
    listed = _listed(nav)
    extra = [
        {_title(path): f"docs/{path.name}"}
        for path in sorted((root / "docs").glob("*.md"))
        if f"docs/{path.name}" not in listed
    ]
    guide = next((entry["Guide"] for entry in nav if isinstance(entry, dict) and "Guide" in entry), None)
    if guide is None:
        nav.extend(extra)
    else:
        guide.extend(extra)


def on_config(config: Any) -> Any:
    root = _root(config)
    _use_checkout(root)
    try:
        pages, reference_nav = _pages(root)
    except reference_api.UndocumentableError as error:
        raise PluginError(str(error)) from None
    _generated.clear()
    _generated.update(pages)
    plugin_nav = [{_title(path): uri} for uri, path in _readmes(root)]
    nav = list(config.nav or [])
    _add_unlisted_guides(nav, root)
    # The plugins' guides after the guide; the generated reference after everything written by hand.
    at = next(
        (i + 1 for i, entry in enumerate(nav) if isinstance(entry, dict) and "Guide" in entry), len(nav)
    )
    nav[at:at] = [{"Plugins": plugin_nav}]
    nav.append({"Reference": reference_nav})
    config.nav = nav
    return config


def on_files(files: Files, config: Any) -> Files:
    root = _root(config)
    docs_dir = Path(config.docs_dir).resolve()
    kept = []
    for file in files:
        source = Path(file.abs_src_path).resolve() if file.abs_src_path else None
        if source is None or docs_dir not in source.parents:
            kept.append(file)  # the theme's assets
        elif source.suffix in (".md", ".png", ".svg") and source.parent == docs_dir:
            # Pages and the plots they show, at their repository paths.
            kept.append(File.generated(config, f"docs/{source.name}", abs_src_path=str(source)))
        # Anything else under docs/ (these generators) is not part of the site.
    sources = [("index.md", root / "README.md"), ("benchmarks/README.md", root / "benchmarks/README.md")]
    sources += _readmes(root)
    kept += [File.generated(config, uri, abs_src_path=str(path)) for uri, path in sources]
    kept += [File.generated(config, uri, content=text) for uri, text in _generated.items()]
    return Files(kept)
