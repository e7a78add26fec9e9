"""What each plugin registers (strategies with their preset options and declared capabilities, launchers,
callbacks, loggers) and each plugin package's reference page.

Registrations are read the way stratagem reads them: the plugin's entry-point modules (from its
pyproject.toml, so the package need not be installed) are imported and their ``register_*`` hooks called with
the registry's own ``register`` callbacks. Those modules import nothing heavy, by the rules of the house.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import tomllib
from reference_api import directive, module_docstring, public_names, resolve

KINDS = ("strategies", "launchers", "callbacks", "loggers")


def registrations(modules: list[str], distribution: str) -> dict[str, list[Any]]:
    """``{kind: [info, ...]}`` of what the plugin modules ``modules`` register."""
    from stratagem.registry._manager import new_plugin_manager
    from stratagem.registry._registry import PluginInfo, Registry

    registry = Registry()
    pm = new_plugin_manager()
    for name in modules:
        module = importlib.import_module(name)
        pm.register(module, name=name)
        info = PluginInfo(name=name, distribution=distribution, version="")
        registrars = {
            "register_strategies": registry.registrar(info),
            "register_launchers": registry.launcher_registrar(info),
            "register_callbacks": registry.callback_registrar(info, "callback"),
            "register_loggers": registry.callback_registrar(info, "logger"),
        }
        for hook, register in registrars.items():
            for impl in getattr(pm.hook, hook).get_hookimpls():
                if impl.plugin is module:
                    impl.function(register=register)
    return {
        "strategies": list(registry.strategies.values()),
        "launchers": list(registry.launchers.values()),
        "callbacks": list(registry.callbacks.values()),
        "loggers": list(registry.loggers.values()),
    }


def core_registrations() -> dict[str, list[Any]]:
    from stratagem.registry import _manager

    builtins = [_manager.BUILTIN_PLUGIN, _manager.BUILTIN_LAUNCHERS, _manager.BUILTIN_CALLBACKS]
    return registrations([*builtins, _manager.BUILTIN_LOGGERS], "stratagem")


def _cell(value: Any) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def _codes(values: Any) -> str:
    return ", ".join(f"`{v}`" for v in values) if values else ""


def _preset(info: Any) -> str:
    return ", ".join(f"`{k}={v!r}`" for k, v in info.preset_options.items())


def _world_sizes(sizes: list[Any]) -> str:
    low, high = sizes
    return f"{low} and more" if high is None else (f"{low}" if low == high else f"{low} to {high}")


def table(kind: str, infos: list[Any]) -> str:
    """A Markdown table of one kind of registration (empty when there is none)."""
    if not infos:
        return ""
    if kind == "strategies":
        head = "| name | description | preset options | declared capabilities |"
        rows = []
        for info in infos:
            caps = info.capabilities.to_json()
            declared = (
                f"accelerators {_codes(caps['accelerators'])}; precisions {_codes(caps['precisions'])}; "
                f"checkpoints {_codes(caps['checkpoint_formats'])}; world size {_world_sizes(caps['world_sizes'])}"
                + (f"; requires {_codes(caps['requires'])}" if caps["requires"] else "")
            )
            rows.append(f"| `{info.name}` | {_cell(info.description)} | {_preset(info)} | {declared} |")
    elif kind == "launchers":
        head = "| name | description | declared capabilities |"
        rows = []
        for info in infos:
            caps = info.capabilities.to_json()
            declared = (
                f"accelerators {_codes(caps['accelerators'])}; "
                f"{'multi-node' if caps['multi_node'] else 'one node'}; "
                f"{'starts every node' if caps['starts_all_nodes'] else 'run on each node'}"
                + (f"; requires {_codes(caps['requires'])}" if caps["requires"] else "")
            )
            rows.append(f"| `{info.name}` | {_cell(info.description)} | {declared} |")
    else:
        head = "| name | description | preset options | requires | install |"
        rows = [
            f"| `{info.name}` | {_cell(info.description)} | {_preset(info)} | {_codes(info.requires)} | "
            f"{_codes(info.install or ())} |"
            for info in infos
        ]
    separator = "|" + " --- |" * head.count(" | ") + " --- |"
    title = {
        "strategies": "Strategies",
        "launchers": "Launchers",
        "callbacks": "Callbacks",
        "loggers": "Loggers",
    }
    return "\n".join([f"### {title[kind]} registered by name", "", head, separator, *rows, ""]) + "\n"


class Plugin:
    """One folder of plugins/: its distribution, package, entry points and README."""

    def __init__(self, folder: Path) -> None:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        self.folder = folder
        self.distribution: str = project["name"]
        self.entry_points: dict[str, str] = project.get("entry-points", {}).get("stratagem", {})
        self.package = next(p.parent.name for p in sorted(folder.glob("src/*/__init__.py")))
        self.readme = folder / "README.md"

    def page(self, loader: Any, root: Path) -> str:
        module = loader.modules_collection[self.package]
        registered = registrations(list(self.entry_points.values()), self.distribution)
        readme = self.readme.relative_to(root).as_posix()
        parts = [
            f"# `{self.package}`\n",
            module_docstring(self.package),
            f"The distribution `{self.distribution}` ([its README](../../{readme}) is the guide); entry points "
            + ", ".join(f'`{name} = "{value}"`' for name, value in self.entry_points.items())
            + ".\n",
        ]
        tables = [table(kind, registered[kind]) for kind in KINDS]
        if any(tables):
            parts += ["## Registered names\n", *[t for t in tables if t]]
        names = public_names(module)
        if names:
            parts.append("## API\n")
            for name in names:
                resolve(module, name)  # a clear error when static analysis cannot find it
                parts.append(directive(f"{self.package}.{name}", heading_level=3))
        return "\n".join(parts)


def plugins(root: Path) -> list[Plugin]:
    return [Plugin(p.parent) for p in sorted(root.glob("plugins/*/pyproject.toml"))]
