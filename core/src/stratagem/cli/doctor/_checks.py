"""What ``stratagem doctor`` checks, one installed entry at a time: the class a name resolves to, each hook
implementation against its spec (as stratagem and pluggy see it), the declarations' types, clashes, missing
requirements, and the certificate a plugin ships. Each finding says what to do."""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import pluggy

from stratagem import hookspecs

OK, NOTE, ERROR, DISABLED = "ok", "note", "error", "disabled"
_MARKER = f"{hookspecs.PROJECT_NAME}_impl"


@attrs.define
class Finding:
    kind: str
    name: str
    distribution: str
    version: str
    status: str = OK
    details: list[str] = attrs.field(factory=list)

    def add(self, status: str, detail: str) -> None:
        # An error outranks a note, a note outranks ok.
        order = (OK, DISABLED, NOTE, ERROR)
        if order.index(status) > order.index(self.status):
            self.status = status
        self.details.append(detail)


def _pluggy_problems(cls: type, hook_names: frozenset[str] | set[str]) -> list[str]:
    """What pluggy refuses when the class's marked methods are registered against the specs of ``hook_names``."""
    import types

    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(types.SimpleNamespace(**{n: getattr(hookspecs, n) for n in hook_names}))
    try:
        manager.register(cls, name=f"doctor:{cls.__module__}.{cls.__qualname__}")
    except (pluggy.PluginValidationError, ValueError) as error:
        return [f"pluggy refuses {cls.__qualname__}: {error}"]
    unknown = [
        f"{cls.__qualname__}.{caller.name} is marked @hookimpl but is no {'/'.join(sorted(_families(hook_names)))} hook"
        for caller in manager.get_hookcallers(cls) or []
        if caller.name not in hook_names
    ]
    return unknown


def _families(hook_names: Any) -> set[str]:
    from stratagem.registry._manager import EVENT_HOOKS, PLAN_HOOKS, STRATEGY_HOOKS

    if set(hook_names) <= EVENT_HOOKS:
        return {"Trainer event"}
    return {"strategy"} if set(hook_names) <= STRATEGY_HOOKS | PLAN_HOOKS else {"launcher"}


def _marked_methods(cls: type) -> dict[str, Any]:
    found = {}
    for attr in dir(cls):
        if attr.startswith("__"):
            continue
        member = inspect.getattr_static(cls, attr, None)
        function = getattr(member, "__func__", member)
        opts = getattr(function, _MARKER, None)
        if opts is not None:
            found[opts.get("specname") or attr] = function
    return found


def check_hook_class(cls: Any, base: type | None, base_name: str, hook_names: frozenset[str]) -> list[str]:
    """Problems of a strategy or launcher class: its base, each override's marker and arguments, and what pluggy
    makes of the class."""
    from stratagem.errors import HookImplementationError
    from stratagem.registry._hook_object import check_hook_overrides

    if not isinstance(cls, type) or (base is not None and not issubclass(cls, base)):
        return [f"the factory gives {cls!r}, not a subclass of {base_name}: subclass it"]
    problems = []
    for klass in cls.__mro__:
        try:
            check_hook_overrides(klass)
        except HookImplementationError as error:
            problems.append(str(error))
    for hook in sorted(hook_names):
        member = inspect.getattr_static(cls, hook, None)
        function = getattr(member, "__func__", member)
        if function is None or not hasattr(function, _MARKER):
            problems.append(f"{cls.__qualname__}.{hook}: not marked @hookimpl, so pluggy never calls it")
    return problems + _pluggy_problems(cls, hook_names)


def check_event_class(cls: Any, kind: str) -> list[str]:
    """Problems of a callback or logger class: its events, their arguments, events left unmarked."""
    from stratagem.registry._manager import EVENT_HOOKS

    if not isinstance(cls, type):
        return [
            f"the factory gives {cls!r}, not a class: register the class (or a 'pkg.module:Class' string)"
        ]
    marked = _marked_methods(cls)
    problems = []
    for event, function in sorted(marked.items()):
        if event not in EVENT_HOOKS:
            problems.append(
                f"{cls.__qualname__}.{function.__name__} is marked @hookimpl but {event!r} is no Trainer event"
            )
            continue
        offered = list(inspect.signature(getattr(hookspecs, event)).parameters)
        taken = [p for p in list(inspect.signature(function).parameters)[1:] if p not in ("args", "kwargs")]
        extra = [p for p in taken if p not in offered]
        if extra:
            problems.append(
                f"{cls.__qualname__}.{event}{inspect.signature(function)} takes {extra}, which the event "
                f"{event}{tuple(offered)} does not offer"
            )
    for event in sorted(EVENT_HOOKS - set(marked)):
        if callable(inspect.getattr_static(cls, event, None)):
            problems.append(
                f"{cls.__qualname__}.{event} is named after an event but not marked @hookimpl: it is never called"
            )
    if not marked:
        problems.append(f"{cls.__qualname__} implements no Trainer event (mark its methods with @hookimpl)")
    if kind == "logger" and marked and not {"log_hyperparams", "log_metrics"} & set(marked):
        problems.append(
            f"{cls.__qualname__} is registered as a logger but implements neither log_hyperparams nor log_metrics"
        )
    events = {e for e in marked if e in EVENT_HOOKS}
    return problems + (_pluggy_problems(cls, events) if events and not problems else [])


def check_contract_declarations(cls: type, capabilities: Any) -> list[str]:
    """The declarations the contract suite reads from a strategy class, when they are plain class attributes
    (a property depends on the options: the suite checks it)."""
    problems = []
    tolerance = inspect.getattr_static(cls, "contract_tolerance", None)
    declared = tolerance is not None and not isinstance(tolerance, property)
    if declared and (
        isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance <= 1e-2
    ):
        problems.append(
            f"contract_tolerance={tolerance!r}: declare a number in (0, 0.01], or None to claim no equivalence"
        )
    size = inspect.getattr_static(cls, "contract_world_size", None)
    declared = size is not None and not isinstance(size, property)
    if declared and (
        isinstance(size, bool) or not isinstance(size, int) or not capabilities.serves_world_size(size)
    ):
        problems.append(f"contract_world_size={size!r}: declare a world size its capabilities serve")
    return problems


def missing_dependencies(distribution: str) -> list[str]:
    """The distribution's own requirements (without extras) that are not installed."""
    import importlib_metadata

    from stratagem.registry.capabilities import _requirement_installed

    try:
        requires = importlib_metadata.distribution(distribution).requires or []
    except importlib_metadata.PackageNotFoundError:
        return []
    try:
        from packaging.requirements import Requirement
    except ImportError:  # cannot read markers: check only the unconditional requirements
        return [r for r in requires if ";" not in r and not _requirement_installed(r)]
    missing = []
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if not _requirement_installed(requirement.name):
            missing.append(str(requirement))
    return missing
