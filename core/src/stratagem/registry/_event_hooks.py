"""The Trainer's events: one plugin manager per Trainer holding only the callbacks and loggers it was given,
called through the typed :class:`TrainerEventHooks` (with :mod:`~stratagem.registry._manager`, the only code that
touches ``pm.hook``)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import pluggy

from stratagem import hookspecs
from stratagem.errors import HookImplementationError
from stratagem.registry._manager import EVENT_HOOKS

#: Events whose implementations the Trainer calls one by one (each gets a state dict of its own).
_PER_CALLBACK_EVENTS = ("on_save_checkpoint", "on_load_checkpoint")


def _event_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(types.SimpleNamespace(**{name: getattr(hookspecs, name) for name in EVENT_HOOKS}))
    return pm


def _check_callback(plugin: object, name: str) -> None:
    """Refuse, naming the callback, a method marked ``@hookimpl`` that no event would ever call."""
    import difflib

    marker = f"{hookspecs.PROJECT_NAME}_impl"
    # Class attributes first (without triggering properties), then what the instance itself holds.
    members = {a: getattr(type(plugin), a, None) for a in dir(type(plugin)) if not a.startswith("__")}
    members.update({a: v for a, v in getattr(plugin, "__dict__", {}).items() if not a.startswith("__")})
    for attr, member in members.items():
        opts = getattr(member, marker, None)
        if opts is None:
            continue
        event = opts.get("specname") or attr
        if event not in EVENT_HOOKS:
            close = difflib.get_close_matches(event, sorted(EVENT_HOOKS), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise HookImplementationError(
                f"Callback {name!r}: {attr} is marked @hookimpl but {event!r} is not a Trainer event, so it "
                f"would never be called.{hint} Events: {', '.join(hookspecs.TRAINER_EVENTS)}."
            )
        if event in _PER_CALLBACK_EVENTS and (opts.get("wrapper") or opts.get("hookwrapper")):
            raise HookImplementationError(
                f"Callback {name!r}: {event} cannot be a wrapper; implement it plainly (it fills a state dict)."
            )


class TrainerEventHooks:
    """The events of one Trainer, calling its callbacks and loggers (in the order given: callbacks, then
    loggers). An event nobody implements costs one set lookup."""

    def __init__(self, plugins: list[tuple[str, object]]) -> None:
        self._pm = _event_manager()
        # pluggy calls the implementation registered last first: register in reverse to keep the given order.
        for name, plugin in reversed(plugins):
            _check_callback(plugin, name)
            try:
                self._pm.register(plugin, name=name)
            except (ValueError, pluggy.PluginValidationError) as error:
                raise HookImplementationError(f"Callback {name!r} cannot be registered: {error}") from error
        self._hook = self._pm.hook
        self.implemented = frozenset(e for e in EVENT_HOOKS if getattr(self._hook, e).get_hookimpls())
        self.names = [name for name, _ in plugins]

    def call(self, event: str, **kwargs: Any) -> None:
        """Run ``event`` in every callback that implements it (keyword arguments as the spec names them)."""
        if event in self.implemented:
            getattr(self._hook, event)(**kwargs)

    def collect_states(self, trainer: Any, path: str) -> dict[str, dict[str, Any]]:
        """Each callback's own state for a checkpoint, keyed by its name."""
        states: dict[str, dict[str, Any]] = {}
        if "on_save_checkpoint" not in self.implemented:
            return states
        for impl in reversed(self._hook.on_save_checkpoint.get_hookimpls()):
            state: dict[str, Any] = {}
            args = {"trainer": trainer, "path": path, "state": state}
            impl.function(*[args[a] for a in impl.argnames])
            if state:
                states[impl.plugin_name] = state
        return states

    def restore_states(self, trainer: Any, path: str, states: Mapping[str, Any]) -> None:
        """Give each callback back what it stored (nothing for one the checkpoint holds no state of)."""
        if "on_load_checkpoint" not in self.implemented:
            return
        for impl in reversed(self._hook.on_load_checkpoint.get_hookimpls()):
            if impl.plugin_name not in states:
                continue
            args = {"trainer": trainer, "path": path, "state": dict(states[impl.plugin_name])}
            impl.function(*[args[a] for a in impl.argnames])
