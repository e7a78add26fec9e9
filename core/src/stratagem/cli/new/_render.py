"""What ``stratagem new KIND NAME`` writes: the files of a plugin package, rendered from the templates shipped in
this package (``templates/``: ``common`` for every kind, one folder per kind, ``strategy-plain`` for the
strategy written by hand) and from the hook specs (:mod:`stratagem.cli.new._hooks`)."""

from __future__ import annotations

import ast
import json
import re
from importlib import resources
from typing import Any

import attrs

KINDS = ("strategy", "launcher", "callback", "logger")
_SUFFIX = {"strategy": "Strategy", "launcher": "Launcher", "callback": "Callback", "logger": "Logger"}
_REGISTER = {
    "strategy": "register_strategies",
    "launcher": "register_launchers",
    "callback": "register_callbacks",
    "logger": "register_loggers",
}
LISTING = {"strategy": "strategies", "launcher": "launchers", "callback": "callbacks", "logger": "callbacks"}
#: A launcher starts from ``elastic`` unless told otherwise: a launcher that launches nothing certifies nothing.
DEFAULT_LAUNCHER_BASE = "elastic"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_PLACEHOLDER = re.compile(r"%%([A-Z0-9_]+)%%")


@attrs.frozen
class Base:
    """The registered plugin a generated one starts from."""

    name: str
    cls: type
    module: str
    class_name: str
    info: Any


def template(path: str) -> str | None:
    found = resources.files(__package__).joinpath("templates", *path.split("/"))
    return found.read_text() if found.is_file() else None


def render(text: str, values: dict[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        if match[1] not in values:
            raise KeyError(f"stratagem new: template placeholder %%{match[1]}%% has no value")
        return values[match[1]]

    return _PLACEHOLDER.sub(value, text)


def check_name(kind: str, name: str) -> None:
    from stratagem.errors import ConfigurationError
    from stratagem.registry._manager import get_registry

    if not _NAME.match(name):
        raise ConfigurationError(
            f"stratagem new {kind} {name!r}: a name is lower-case letters, digits and underscores, starting with "
            "a letter (it is the registered name and part of the package's)."
        )
    registry = get_registry()
    table = {
        "strategy": registry.strategies,
        "launcher": registry.launchers,
        "callback": registry.callbacks,
        "logger": registry.loggers,
    }[kind]
    if name in table:
        raise ConfigurationError(
            f"stratagem new {kind} {name!r}: a {kind} of that name is installed already (from "
            f"{table[name].plugin.distribution}); the two would clash. Pick another name."
        )
    from stratagem.registry._manager import _entry_points

    taken = {ep.name: ep.dist.name if ep.dist else "?" for ep in _entry_points()}
    if name in taken:
        raise ConfigurationError(
            f"stratagem new {kind} {name!r}: {taken[name]} declares the entry point {name!r} already, and "
            "STRATAGEM_PLUGINS / STRATAGEM_DISABLE_PLUGINS could not tell the two apart. Pick another name."
        )


def resolve_base(kind: str, based_on: str | None) -> Base | None:
    """The registered strategy or launcher to start from (``None``: a strategy written by hand)."""
    from stratagem.errors import ConfigurationError
    from stratagem.registry._manager import get_registry

    if kind in ("callback", "logger"):
        if based_on:
            raise ConfigurationError(
                f"stratagem new {kind}: --based-on applies to strategies and launchers; a {kind} has no base."
            )
        return None
    if kind == "launcher":
        based_on = based_on or DEFAULT_LAUNCHER_BASE
    if not based_on:
        return None
    registry = get_registry()
    info = registry.get(based_on) if kind == "strategy" else registry.get_launcher(based_on)
    factory = info.factory
    if isinstance(factory, str):
        module, _, class_name = factory.partition(":")
    else:
        module, class_name = factory.__module__, factory.__qualname__
    if "." in class_name:
        raise ConfigurationError(
            f"--based-on {based_on}: its class {factory!r} is nested; import it by hand."
        )
    from stratagem.registry._registry import _load_factory

    cls = _load_factory(info.name, info.factory, info.plugin)
    return Base(name=based_on, cls=cls, module=module, class_name=class_name, info=info)


def _set(values: Any) -> str:
    return "{" + ", ".join(json.dumps(v) for v in sorted(values)) + "}"


def _call(name: str, fields: list[str]) -> str:
    return f"{name}(\n" + "".join(f"            {field},\n" for field in fields) + "        )"


def capabilities(kind: str, base: Base | None) -> str:
    if kind == "strategy":
        if base is None:
            fields = ['accelerators={"cpu", "cuda"}', 'precisions={"32-true", "bf16-mixed"}']
            return _call("Capabilities", [*fields, 'checkpoint_formats={"full"}', "min_world_size=1"])
        caps = base.info.capabilities
        fields = [
            f"accelerators={_set(caps.accelerators)}",
            f"precisions={_set(caps.precisions)}",
            f"checkpoint_formats={_set(caps.checkpoint_formats)}",
            f"min_world_size={caps.min_world_size}",
            f"max_world_size={caps.max_world_size!r}",
        ]
    elif kind == "launcher":
        assert base is not None
        caps = base.info.capabilities
        fields = [f"accelerators={_set(caps.accelerators)}", f"multi_node={caps.multi_node!r}"]
        if caps.starts_all_nodes:
            fields.append("starts_all_nodes=True")
    else:
        return ""
    if caps.requires:
        fields.append(f"requires={tuple(caps.requires)!r}")
    return _call("Capabilities" if kind == "strategy" else "LauncherCapabilities", fields)


def presets(base: Base | None) -> str:
    """The base name's preset options, as keyword arguments of ``register``."""
    from stratagem.errors import ConfigurationError

    if base is None:
        return ""
    lines = []
    for key, value in sorted(base.info.preset_options.items()):
        try:
            same = ast.literal_eval(repr(value)) == value
        except (ValueError, SyntaxError):
            same = False
        if not same:
            raise ConfigurationError(
                f"--based-on {base.name}: its preset option {key}={value!r} cannot be written as a literal; "
                "start from a name without it and pass the option in code."
            )
        lines.append(f"\n        {key}={value!r},")
    return "".join(lines)


def class_name(kind: str, name: str) -> str:
    camel = "".join(part.capitalize() for part in name.split("_"))
    return camel if camel.endswith(_SUFFIX[kind]) else camel + _SUFFIX[kind]


def values(kind: str, name: str, base: Base | None) -> dict[str, str]:
    from stratagem.registry._version import __version__

    dist = "stratagem-" + name.replace("_", "-")
    minor = ".".join(__version__.split(".")[:2])
    dependencies = [f'"stratagem>={minor}"']
    if base is not None and base.info.plugin.distribution != "stratagem":
        dependencies.append(f'"{base.info.plugin.distribution}>={base.info.plugin.version}"')
    flags = {"strategy": [], "launcher": ["--launcher"], "callback": ["--callback"], "logger": ["--logger"]}
    lookup = {
        "strategy": f'get_registry().get("{name}")',
        "launcher": f'get_registry().get_launcher("{name}")',
        "callback": f'get_registry().get_callback("{name}", "callback")',
        "logger": f'get_registry().get_callback("{name}", "logger")',
    }
    return {
        "NAME": name,
        "KIND": kind,
        "DIST": dist,
        "PACKAGE": dist.replace("-", "_"),
        "MODULE": kind,
        "CLASS": class_name(kind, name),
        "LISTING": LISTING[kind],
        "REGISTER_HOOK": _REGISTER[kind],
        "DEPENDENCIES": ", ".join(dependencies),
        "STRATAGEM_VERSION": __version__,
        "BASED_ON_FLAG": f" --based-on {base.name}" if base is not None and kind == "strategy" else "",
        "CAPABILITIES": capabilities(kind, base),
        "PRESETS": presets(base),
        "CONTRACT_ARGS": ", ".join(json.dumps(a) for a in [*flags[kind], name]),
        "CONTRACT_CLI": " ".join([*flags[kind], name]),
        "LOOKUP": lookup[kind],
    }
