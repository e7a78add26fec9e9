"""A Trainer's callbacks and loggers: names resolved through the registry (before anything launches), the
name each is registered under (its key in checkpoints), the events its parts send them, and the hyperparameters
loggers record."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from stratagem import hookspecs
from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.registry._event_hooks import TrainerEventHooks
    from stratagem.trainer._options import TrainerOptions

#: What ``Trainer(loggers=None)`` means.
DEFAULT_LOGGERS = ("csv",)
_MARKER = f"{hookspecs.PROJECT_NAME}_impl"


def _implements_an_event(obj: object) -> bool:
    members = [getattr(type(obj), a, None) for a in dir(type(obj))]
    members += list(getattr(obj, "__dict__", {}).values())
    return any(getattr(member, _MARKER, None) is not None for member in members)


def resolve(items: Any, kind: str) -> list[object]:
    """Instances for ``items``: names are created from the registry (unknown ones are refused with the names
    that exist, a missing optional dependency with the pip command); objects are taken as they are."""
    if items is None:
        items = DEFAULT_LOGGERS if kind == "logger" else ()
    if items is False:  # loggers=False: none, as loggers=[]
        return []
    if isinstance(items, str) or not isinstance(items, Sequence):
        items = [items]
    resolved: list[object] = []
    for item in items:
        if isinstance(item, str):
            from stratagem.registry._manager import get_registry

            resolved.append(get_registry().get_callback(item, kind).create())
            continue
        if isinstance(item, type):
            raise ConfigurationError(
                f"Trainer({kind}s=[{item.__name__}]): give an instance, {item.__name__}(...), not the class."
            )
        if not _implements_an_event(item):
            raise ConfigurationError(
                f"Trainer({kind}s=[...]): {type(item).__name__} implements no Trainer event. Mark its methods "
                "with @stratagem.hookimpl and name them after the events (on_fit_start, on_train_batch_end, "
                "log_metrics, ...; see docs/hooks.md)."
            )
        resolved.append(item)
    return resolved


def named(plugins: list[object]) -> list[tuple[str, object]]:
    """Each plugin with its name: its ``state_key`` if it has one, else its class; repeats get ``#2``, ``#3``.
    The name keys the plugin's state in checkpoints, so a resumed run must list its callbacks the same way."""
    seen: dict[str, int] = {}
    result = []
    for plugin in plugins:
        base = getattr(plugin, "state_key", None) or type(plugin).__qualname__
        seen[base] = seen.get(base, 0) + 1
        result.append((base if seen[base] == 1 else f"{base}#{seen[base]}", plugin))
    return result


class TrainerEvents:
    """The events a Trainer's parts send, each with ``trainer=`` the public Trainer: the one thing of it they
    hold, and only to hand it to the callbacks and loggers (its events API)."""

    def __init__(self, hooks: TrainerEventHooks, trainer: object) -> None:
        self._hooks = hooks
        self._trainer = trainer

    @property
    def implemented(self) -> frozenset[str]:
        return self._hooks.implemented

    def call(self, event: str, **kwargs: Any) -> None:
        self._hooks.call(event, trainer=self._trainer, **kwargs)

    def collect_states(self, path: str) -> dict[str, dict[str, Any]]:
        return self._hooks.collect_states(self._trainer, path)

    def restore_states(self, path: str, states: Mapping[str, Any]) -> None:
        self._hooks.restore_states(self._trainer, path, states)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def _flatten(prefix: str, values: Mapping[str, Any], out: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, Mapping):
            _flatten(f"{prefix}{key}/", value, out)
        else:
            out[f"{prefix}{key}"] = _plain(value)


def hyperparameters(options: TrainerOptions, engine: Engine, module: Any) -> dict[str, Any]:
    """The run's options for loggers: the Trainer's, the strategy's config, and the model's ``hparams``."""
    params: dict[str, Any] = {}
    _flatten("trainer/", attrs.asdict(options, recurse=False), params)
    params.update(
        {
            "trainer/devices": engine.devices,
            "trainer/num_nodes": engine.num_nodes,
            "trainer/precision": str(engine.precision),
            "trainer/world_size": engine.world_size,
            "strategy/name": getattr(engine.strategy, "registered_name", "")
            or type(engine.strategy).__name__,
        }
    )
    config = getattr(engine.strategy, "config", None)
    if config is not None and attrs.has(type(config)):
        _flatten("strategy/", attrs.asdict(config, recurse=False), params)
    hparams = getattr(module, "hparams", None)
    if isinstance(hparams, Mapping):
        _flatten("model/", hparams, params)
    elif hparams is not None and attrs.has(type(hparams)):
        _flatten("model/", attrs.asdict(hparams, recurse=False), params)
    return params
