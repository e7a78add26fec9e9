"""The plugin manager: with :mod:`~stratagem.registry._event_hooks`, the only code that touches ``pm.hook``.

Discovery loads the entry points of the group ``stratagem`` and asks each plugin to
``register_strategies(register)``. At run time a fresh manager holds the chosen strategy (the only plain
implementation of each strategy operation) and the add-on plugins, whose implementations must be wrappers.
Each Trainer has a manager of its own for its events, holding only the callbacks and loggers it was given
(:mod:`stratagem.registry._event_hooks`). Callers use the typed methods of :class:`StrategyHooks`,
:class:`LauncherHooks` and :class:`~stratagem.registry._event_hooks.TrainerEventHooks`, never ``pm.hook``.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ContextManager

import attrs
import pluggy

from stratagem import hookspecs
from stratagem.errors import HookImplementationError, PluginLoadError
from stratagem.registry._registry import PluginInfo, Registry

if TYPE_CHECKING:
    import torch

    from stratagem.launchers.cluster import ClusterEnvironment
    from stratagem.strategies import Strategy

ENTRY_POINT_GROUP = "stratagem"
PLUGINS_ENV = "STRATAGEM_PLUGINS"
#: Entry-point names never to load (``*``: every plugin but the built-ins), to bypass a broken plugin without
#: uninstalling it; the listings say which were disabled.
DISABLE_ENV = "STRATAGEM_DISABLE_PLUGINS"
BUILTIN_PLUGIN = "stratagem.strategies._builtin_strategies"
BUILTIN_LAUNCHERS = "stratagem.launchers._builtin_launchers"
BUILTIN_CALLBACKS = "stratagem.callbacks._builtin_callbacks"
BUILTIN_LOGGERS = "stratagem.loggers._builtin_loggers"
#: Discovery hooks (every implementation runs) and the launcher's operation: not strategy operations.
DISCOVERY_HOOKS = frozenset(
    {
        "register_strategies",
        "register_launchers",
        "register_callbacks",
        "register_loggers",
        "register_install_hints",
    }
)
LAUNCHER_HOOKS = frozenset({"launch_workers"})
#: Asked of the chosen strategy by the plan (``stratagem plan``, ``strategy="auto"``), never during a run.
PLAN_HOOKS = frozenset({"estimate_memory"})
#: The Trainer's events: broadcast hooks of callbacks and loggers, never of a strategy.
EVENT_HOOKS = frozenset(hookspecs.TRAINER_EVENTS)

#: Hooks whose plain implementation belongs to the chosen strategy alone.
STRATEGY_HOOKS = (
    frozenset(
        name
        for name in dir(hookspecs)
        if not name.startswith("_") and hasattr(getattr(hookspecs, name), "stratagem_spec")
    )
    - DISCOVERY_HOOKS
    - LAUNCHER_HOOKS
    - EVENT_HOOKS
    - PLAN_HOOKS
)


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _allowed(environ: Mapping[str, str]) -> set[str] | None:
    """The entry-point names ``STRATAGEM_PLUGINS`` allows (``None``: all; empty: none but built-ins)."""
    if PLUGINS_ENV not in environ:
        return None
    return {part.strip() for part in environ[PLUGINS_ENV].split(",") if part.strip()}


def _disabled(environ: Mapping[str, str]) -> set[str]:
    """The entry-point names ``STRATAGEM_DISABLE_PLUGINS`` names (``{"*"}``: all)."""
    return {part.strip() for part in environ.get(DISABLE_ENV, "").split(",") if part.strip()}


def package_dir(module: types.ModuleType) -> str:
    """The folder of the package that holds ``module`` (itself, for a package): where a plugin ships its
    certificate. Empty for a top-level module outside any package."""
    import sys

    spec = getattr(module, "__spec__", None)
    parent = spec.parent if spec is not None else ""
    package = sys.modules.get(parent) if parent else None
    locations = getattr(getattr(package, "__spec__", None), "submodule_search_locations", None) or []
    return next(iter(locations), "")


def _entry_points() -> list[Any]:
    from stratagem.registry import _installed

    seen: set[tuple[str, str]] = set()
    unique = []
    # The same distribution can be visible twice on sys.path (an editable install and a build dir).
    for ep in _installed.entry_points(ENTRY_POINT_GROUP):
        key = (ep.name, ep.value)
        if key not in seen:
            seen.add(key)
            unique.append(ep)
    return unique


def discover(environ: Mapping[str, str] | None = None) -> tuple[Registry, list[types.ModuleType]]:
    """Load the built-in and installed plugins and collect their strategies.

    A plugin that fails to import or to register is recorded in ``registry.broken`` and skipped; the others
    load. Returns the registry and the plugin modules that loaded (for the run-time manager).
    """
    import importlib

    env = os.environ if environ is None else environ
    registry = Registry()
    modules: list[types.ModuleType] = []
    pm = new_plugin_manager()
    version = _own_version()
    builtin = PluginInfo(name="stratagem", distribution="stratagem", version=version)
    candidates: list[tuple[PluginInfo, Any]] = [
        (builtin, name) for name in (BUILTIN_PLUGIN, BUILTIN_LAUNCHERS, BUILTIN_CALLBACKS, BUILTIN_LOGGERS)
    ]
    allowed, disabled = _allowed(env), _disabled(env)
    for ep in _entry_points():
        if allowed is not None and ep.name not in allowed:
            continue
        dist = ep.dist
        info = PluginInfo(
            name=ep.name,
            distribution=dist.name if dist else "(unknown)",
            version=dist.version if dist else "?",
        )
        if ep.name in disabled or "*" in disabled:
            registry.disabled.append(info)  # its module is never imported
            continue
        candidates.append((info, ep))
    for info, source in candidates:
        label = source if isinstance(source, str) else f"{source.name} = {source.value}"
        try:
            module = importlib.import_module(source) if isinstance(source, str) else source.load()
            if not isinstance(source, str):
                info = attrs.evolve(info, location=package_dir(module))
            pm.register(module, name=f"{info.name}:{getattr(module, '__name__', label)}")
            for impl in pm.hook.register_strategies.get_hookimpls():
                if impl.plugin is module:
                    impl.function(register=registry.registrar(info))
            for impl in pm.hook.register_launchers.get_hookimpls():
                if impl.plugin is module:
                    impl.function(register=registry.launcher_registrar(info))
            for impl in pm.hook.register_callbacks.get_hookimpls():
                if impl.plugin is module:
                    impl.function(register=registry.callback_registrar(info, "callback"))
            for impl in pm.hook.register_loggers.get_hookimpls():
                if impl.plugin is module:
                    impl.function(register=registry.callback_registrar(info, "logger"))
            for impl in pm.hook.register_install_hints.get_hookimpls():
                if impl.plugin is module:
                    impl.function(register=registry.hints.registrar(info))
        except Exception as error:
            registry.broken.append(PluginLoadError(label, info.distribution, info.version, error))
            continue
        modules.append(module)
    return registry, modules


def _own_version() -> str:
    from stratagem.registry._version import __version__

    return __version__


_cache: dict[tuple[str | None, str | None], tuple[Registry, list[types.ModuleType]]] = {}
_cache_lock = threading.Lock()


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, built on first use (``refresh`` rebuilds it)."""
    return _cached(refresh)[0]


def _cached(refresh: bool = False) -> tuple[Registry, list[types.ModuleType]]:
    key = (os.environ.get(PLUGINS_ENV), os.environ.get(DISABLE_ENV))
    with _cache_lock:
        if refresh or key not in _cache:
            _cache[key] = discover()
        return _cache[key]


def installed_plugins() -> list[types.ModuleType]:
    """The plugin modules that loaded (the add-ons every StrategyHooks registers by default)."""
    return list(_cached()[1])


def _check_addon(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    for hook_name in STRATEGY_HOOKS | PLAN_HOOKS:
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                raise HookImplementationError(
                    f"Plugin {name!r} implements the strategy operation {hook_name!r} as a plain hook. Only the "
                    f"chosen strategy may; an add-on must use @hookimpl(wrapper=True) around it."
                )


class StrategyHooks:
    """Typed calls into the chosen strategy and the add-ons wrapped around it."""

    def __init__(self, strategy: Strategy, addons: list[object] | None = None) -> None:
        self.strategy = strategy
        self._pm = new_plugin_manager()
        for addon in _cached()[1] if addons is None else addons:
            name = getattr(addon, "__name__", None) or type(addon).__name__
            self._pm.register(addon, name=f"addon:{name}")
            _check_addon(self._pm, addon, name)
        self._pm.register(
            strategy, name=f"strategy:{getattr(strategy, 'registered_name', type(strategy).__name__)}"
        )
        self._hook = self._pm.hook

    # environment ----------------------------------------------------------------------------------
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        self._hook.setup_environment(cluster=cluster, precision=precision)

    # model -----------------------------------------------------------------------------------------
    def model_init_context(self, empty_init: bool) -> ContextManager[None]:
        return self._hook.model_init_context(empty_init=empty_init)

    def model_sharded_context(self) -> ContextManager[None]:
        return self._hook.model_sharded_context()

    def wrap_model(self, model: torch.nn.Module, compiler: Any) -> torch.nn.Module:
        return self._hook.wrap_model(model=model, compiler=compiler)

    def strategy_takes(self, hook: str, argument: str) -> bool:
        """Whether the strategy's own implementation of ``hook`` takes ``argument``: one a spec offers and an
        implementation may leave out, where taking it is how the strategy answers (``wrap_model``'s
        ``compiler``)."""
        for impl in getattr(self._hook, hook).get_hookimpls():
            if impl.plugin is self.strategy:
                return argument in impl.argnames
        return False

    def forward_context(self) -> ContextManager[None]:
        return self._hook.forward_context()

    # optimization ----------------------------------------------------------------------------------
    def setup_optimizers(self, model: torch.nn.Module, optimizers: list[Any]) -> list[Any]:
        return list(self._hook.setup_optimizers(model=model, optimizers=list(optimizers)))

    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        self._hook.backward(loss=loss, model=model)

    def optimizer_step(self, optimizer: Any, model: torch.nn.Module) -> None:
        self._hook.optimizer_step(optimizer=optimizer, model=model)

    def clip_gradients(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        return self._hook.clip_gradients(model=model, optimizer=optimizer, max_norm=max_norm)

    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        return self._hook.no_sync(model=model)

    # step ------------------------------------------------------------------------------------------
    def check_batch_size(self, batch_size: int) -> None:
        self._hook.check_batch_size(batch_size=batch_size)

    def run_training_batch(
        self,
        model: torch.nn.Module,
        batch: Any,
        batch_idx: int,
        split_batch: Any,
        compute_loss: Any,
        loss_scale: float,
    ) -> Any:
        return self._hook.run_training_batch(
            model=model,
            batch=batch,
            batch_idx=batch_idx,
            split_batch=split_batch,
            compute_loss=compute_loss,
            loss_scale=loss_scale,
        )

    def run_evaluation_batch(
        self,
        model: torch.nn.Module,
        batch: Any,
        batch_idx: int,
        split_batch: Any,
        compute_loss: Any,
        stage: str,
    ) -> Any:
        return self._hook.run_evaluation_batch(
            model=model,
            batch=batch,
            batch_idx=batch_idx,
            split_batch=split_batch,
            compute_loss=compute_loss,
            stage=stage,
        )

    # data ------------------------------------------------------------------------------------------
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return self._hook.distributed_sampler_kwargs()

    # checkpoint ------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, state: dict[str, Any], format: str) -> None:
        self._hook.save_checkpoint(path=path, state=state, format=format)

    def load_checkpoint(self, path: str, state: dict[str, Any], strict: bool) -> dict[str, Any]:
        return self._hook.load_checkpoint(path=path, state=state, strict=strict)

    def weight_shards(self, model: torch.nn.Module, purpose: str) -> list[Any]:
        return list(self._hook.weight_shards(model=model, purpose=purpose))

    # collectives -----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return self._hook.all_reduce(tensor=tensor, op=op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._hook.all_gather(tensor=tensor)

    def broadcast(self, obj: Any, src: int) -> Any:
        return self._hook.broadcast(obj=obj, src=src)

    def barrier(self, name: str | None) -> None:
        self._hook.barrier(name=name)

    # teardown --------------------------------------------------------------------------------------
    def teardown(self) -> None:
        self._hook.teardown()

    # planning --------------------------------------------------------------------------------------
    def estimate_memory(self, model: torch.nn.Module, world: Any) -> Any:
        return self._hook.estimate_memory(model=model, world=world)


class LauncherHooks:
    """The typed call into the chosen launcher."""

    def __init__(self, launcher: object) -> None:
        self._pm = new_plugin_manager()
        self._pm.register(launcher, name=f"launcher:{getattr(launcher, 'name', type(launcher).__name__)}")
        self._hook = self._pm.hook

    def launch_workers(self, job: Any) -> dict[int, Any]:
        result = self._hook.launch_workers(job=job)
        return {} if result is None else dict(result)
