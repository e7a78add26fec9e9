"""The strategy registry: names, factories, declared capabilities, and where each came from."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.errors import (
    CapabilityError,
    ConfigurationError,
    MissingDependencyError,
    PluginLoadError,
    StrategyConflictError,
    UnknownLauncherError,
    UnknownNameError,
    UnknownStrategyError,
)
from stratagem.registry._hints import InstallHints, auto_strategy
from stratagem.registry._hook_object import HookObject
from stratagem.registry.capabilities import Capabilities, LauncherCapabilities

if TYPE_CHECKING:
    from stratagem.strategies import Strategy

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


@attrs.frozen(kw_only=True)
class PluginInfo:
    """Where a group of registrations came from."""

    name: str
    distribution: str
    version: str
    #: The folder of the package holding the entry-point module (where a shipped certificate lies), or "".
    location: str = ""


@attrs.frozen(kw_only=True)
class StrategyInfo:
    """One registered strategy name.

    :param factory: a ``Strategy`` subclass or a ``"pkg.module:Class"`` string imported only when chosen.
    :param preset_options: keyword arguments the name implies (``fsdp_cpu_offload`` -> ``cpu_offload=True``).
    """

    name: str
    factory: type | str = attrs.field(repr=False)
    description: str
    capabilities: Capabilities
    preset_options: Mapping[str, Any] = attrs.field(factory=dict)
    plugin: PluginInfo

    def resolve_factory(self) -> type[Strategy]:
        """Import the factory if it is a string; fails with the requirement when a dependency is missing."""
        missing = self.capabilities.missing_requirements()
        if missing:
            raise MissingDependencyError(self.name, missing)
        return _load_factory(self.name, self.factory, self.plugin)

    def create(self, **options: Any) -> Strategy:
        """Instantiate the strategy with the preset options, overridden by ``options``."""
        return _instance(self, self.resolve_factory(), options, "strategy", "stratagem.strategies.Strategy")

    def to_json(self) -> dict[str, Any]:
        missing = self.capabilities.missing_requirements()
        return {
            "name": self.name,
            "description": self.description,
            "distribution": self.plugin.distribution,
            "version": self.plugin.version,
            "plugin": self.plugin.name,
            "capabilities": self.capabilities.to_json(),
            "preset_options": {k: repr(v) for k, v in self.preset_options.items()},
            "missing": missing,
        }


@attrs.frozen(kw_only=True)
class LauncherInfo:
    """One registered launcher name (see :class:`StrategyInfo`; the same rules)."""

    name: str
    factory: type | str = attrs.field(repr=False)
    description: str
    capabilities: Any
    preset_options: Mapping[str, Any] = attrs.field(factory=dict)
    plugin: PluginInfo

    def create(self, **options: Any) -> Any:
        missing = self.capabilities.missing_requirements()
        if missing:
            raise MissingDependencyError(self.name, missing)
        cls = _load_factory(self.name, self.factory, self.plugin)
        return _instance(self, cls, options, "launcher", "stratagem.launchers.Launcher")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "distribution": self.plugin.distribution,
            "version": self.plugin.version,
            "plugin": self.plugin.name,
            "capabilities": self.capabilities.to_json(),
            "missing": self.capabilities.missing_requirements(),
        }


@attrs.frozen(kw_only=True)
class CallbackInfo:
    """One registered callback or logger name (``kind``): created only when a Trainer names it.

    :param requires: distributions it needs, checked through package metadata before anything launches.
    :param install: what to ``pip install`` when one is missing (default: ``requires``).
    """

    kind: str
    name: str
    factory: type | str = attrs.field(repr=False)
    description: str
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    install: tuple[str, ...] | None = None
    preset_options: Mapping[str, Any] = attrs.field(factory=dict)
    plugin: PluginInfo

    def missing_requirements(self) -> list[str]:
        from stratagem.registry.capabilities import _requirement_installed

        return [r for r in self.requires if not _requirement_installed(r)]

    def check_installed(self) -> None:
        missing = self.missing_requirements()
        if missing:
            raise MissingDependencyError(
                self.name, missing, kind=self.kind.capitalize(), install=self.install or missing
            )

    def create(self, **options: Any) -> Any:
        self.check_installed()
        cls = _load_factory(self.name, self.factory, self.plugin)
        return cls(**{**self.preset_options, **options})

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "description": self.description,
            "distribution": self.plugin.distribution,
            "version": self.plugin.version,
            "plugin": self.plugin.name,
            "requires": list(self.requires),
            "missing": self.missing_requirements(),
            "install": " ".join(f"'{r}'" for r in (self.install or self.missing_requirements())),
        }


def _instance(info: Any, cls: Any, options: Mapping[str, Any], kind: str, base_name: str) -> Any:
    """``cls`` built with the registered preset options overridden by ``options``, checked to be a hook object
    of that ``kind`` (a subclass of ``base_name``) and given the name it was registered under."""
    made = cls(**{**info.preset_options, **options})
    if not (isinstance(made, HookObject) and made.plugin_kind == kind):
        raise ConfigurationError(
            f"{kind.capitalize()} {info.name!r} from {info.plugin.distribution}: factory {info.factory!r} built a "
            f"{type(made).__name__}, not a {base_name}."
        )
    made.registered_name = info.name
    return made


def _load_factory(name: str, factory: type | str, plugin: PluginInfo) -> Any:
    if not isinstance(factory, str):
        return factory
    module_name, _, attr = factory.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as error:
        raise PluginLoadError(f"{name} -> {factory}", plugin.distribution, plugin.version, error) from error
    return target


def _check_registration(kind: str, name: str, factory: Any, description: str) -> None:
    if not name or not set(name) <= _NAME_CHARS:
        raise ValueError(f"register({name!r}): a {kind} name is lower-case letters, digits and underscores.")
    if not isinstance(factory, (str, type)):
        raise TypeError(f"register({name!r}): factory must be a class or 'pkg.module:Class' string.")
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(f"register({name!r}): factory string {factory!r} must look like 'pkg.module:Class'.")
    if not description:
        raise ValueError(f"register({name!r}): give a one-line description for the listing.")


@attrs.define
class Registry:
    """Every strategy name known to this process, plus the plugins that failed to load."""

    strategies: dict[str, StrategyInfo] = attrs.field(factory=dict)
    broken: list[PluginLoadError] = attrs.field(factory=list)
    conflicts: dict[str, StrategyConflictError] = attrs.field(factory=dict)
    launchers: dict[str, LauncherInfo] = attrs.field(factory=dict)
    callbacks: dict[str, CallbackInfo] = attrs.field(factory=dict)
    loggers: dict[str, CallbackInfo] = attrs.field(factory=dict)
    #: Plugins named by ``STRATAGEM_DISABLE_PLUGINS``: found, never imported.
    disabled: list[PluginInfo] = attrs.field(factory=list)
    #: What the installed plugins say about names they do not register (``register_install_hints``).
    hints: InstallHints = attrs.field(factory=InstallHints)

    def callback_registrar(self, plugin: PluginInfo, kind: str) -> Callable[..., None]:
        """The ``register`` callback handed to one plugin's ``register_callbacks`` (or ``register_loggers``)."""
        table = self.callbacks if kind == "callback" else self.loggers

        def register(
            name: str,
            factory: type | str,
            *,
            description: str,
            requires: tuple[str, ...] | list[str] = (),
            install: tuple[str, ...] | list[str] | str | None = None,
            **preset_options: Any,
        ) -> None:
            _check_registration(kind, name, factory, description)
            if name in table:
                raise StrategyConflictError(name, table[name].plugin.distribution, plugin.distribution)
            table[name] = CallbackInfo(
                kind=kind,
                name=name,
                factory=factory,
                description=description,
                requires=tuple(requires),
                install=(install,)
                if isinstance(install, str)
                else (None if install is None else tuple(install)),
                preset_options=dict(preset_options),
                plugin=plugin,
            )

        return register

    def get_callback(self, name: str, kind: str = "callback") -> CallbackInfo:
        table = self.callbacks if kind == "callback" else self.loggers
        try:
            return table[name]
        except KeyError:
            raise UnknownNameError(kind, name, table, self.hints.sentence(kind, name)) from None

    def launcher_registrar(self, plugin: PluginInfo) -> Callable[..., None]:
        """The ``register`` callback handed to one plugin's ``register_launchers``."""

        def register(
            name: str,
            factory: type | str,
            *,
            description: str,
            capabilities: Any = None,
            **preset_options: Any,
        ) -> None:
            _check_registration("launcher", name, factory, description)
            if name in self.launchers:
                raise StrategyConflictError(
                    name, self.launchers[name].plugin.distribution, plugin.distribution
                )
            self.launchers[name] = LauncherInfo(
                name=name,
                factory=factory,
                description=description,
                capabilities=capabilities or LauncherCapabilities(),
                preset_options=dict(preset_options),
                plugin=plugin,
            )

        return register

    def get_launcher(self, name: str) -> LauncherInfo:
        try:
            return self.launchers[name]
        except KeyError:
            raise UnknownLauncherError(name, self.launchers, self.hints.sentence("launcher", name)) from None

    def check_launcher(self, name: str, *, accelerator: str, num_nodes: int) -> LauncherInfo:
        """The launcher's info, after checking the request against what it declares."""
        info = self.get_launcher(name)
        refusal = info.capabilities.refusal(accelerator=accelerator, num_nodes=num_nodes)
        if refusal is not None:
            able = [
                other.name
                for other in self.launchers.values()
                if other.capabilities.refusal(accelerator=accelerator, num_nodes=num_nodes) is None
            ]
            raise ConfigurationError(
                f"Launcher {name!r} cannot run {refusal}. Launchers that can: {', '.join(sorted(able)) or '(none)'}."
            )
        missing = info.capabilities.missing_requirements()
        if missing:
            raise MissingDependencyError(name, missing)
        return info

    def registrar(self, plugin: PluginInfo) -> Callable[..., None]:
        """The ``register`` callback handed to one plugin's ``register_strategies``."""

        def register(
            name: str,
            factory: type | str,
            *,
            description: str,
            capabilities: Capabilities | None = None,
            **preset_options: Any,
        ) -> None:
            _check_registration("strategy", name, factory, description)
            info = StrategyInfo(
                name=name,
                factory=factory,
                description=description,
                capabilities=capabilities or Capabilities(),
                preset_options=dict(preset_options),
                plugin=plugin,
            )
            if name in self.conflicts:
                return
            existing = self.strategies.get(name)
            if existing is not None:
                self.conflicts[name] = StrategyConflictError(
                    name, existing.plugin.distribution, plugin.distribution
                )
                del self.strategies[name]
                return
            self.strategies[name] = info

        return register

    def names(self) -> list[str]:
        return sorted(self.strategies)

    def __iter__(self) -> Iterator[StrategyInfo]:
        return iter(self.strategies[name] for name in self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.strategies

    def get(self, name: str) -> StrategyInfo:
        if name in self.conflicts:
            raise self.conflicts[name]
        try:
            return self.strategies[name]
        except KeyError:
            hint = ""
            if self.broken:
                hint = (
                    "Plugins that failed to load: "
                    + "; ".join(f"{b.entry_point} ({b.distribution})" for b in self.broken)
                    + ". Run `stratagem strategies` for details."
                )
            install = self.hints.sentence("strategy", name)
            raise UnknownStrategyError(name, self.names(), hint, install) from None

    def auto(
        self, *, world_size: int, accelerator: str | None = None, precision: str | None = None
    ) -> StrategyInfo:
        """What ``strategy="auto"`` means: the core's ``single_device`` for one process; for more, the strategy
        that declares the highest ``auto_priority`` among those serving the request (ties: by name)."""
        if world_size == 1:
            return self.get("single_device")
        return auto_strategy(
            self, self.hints, world_size=world_size, accelerator=accelerator, precision=precision
        )

    def check_request(
        self,
        name: str,
        *,
        accelerator: str | None = None,
        precision: str | None = None,
        world_size: int | None = None,
        checkpoint_format: str | None = None,
    ) -> StrategyInfo:
        """The strategy's info, after checking the request against its declared capabilities."""
        info = self.get(name)
        request = dict(
            accelerator=accelerator,
            precision=precision,
            world_size=world_size,
            checkpoint_format=checkpoint_format,
        )
        refusal = info.capabilities.refusal(**request)
        if refusal is not None:
            capability, requested = refusal
            alternatives = [other.name for other in self if other.capabilities.refusal(**request) is None]
            raise CapabilityError(name, capability, requested, alternatives)
        missing = info.capabilities.missing_requirements()
        if missing:
            raise MissingDependencyError(name, missing)
        return info
