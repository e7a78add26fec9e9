"""The base of every object whose methods implement hooks (strategies, launchers): its overrides of hooks are
checked when its class is defined, and it knows the name it was registered under. Imports nothing heavy."""

from __future__ import annotations

import inspect
from typing import Any

from stratagem import hookspecs
from stratagem.errors import HookImplementationError


def _spec_arguments() -> dict[str, tuple[str, ...]]:
    specs = {}
    for name in dir(hookspecs):
        function = getattr(hookspecs, name)
        if callable(function) and hasattr(function, f"{hookspecs.PROJECT_NAME}_spec"):
            specs[name] = tuple(inspect.signature(function).parameters)
    return specs


HOOK_ARGUMENTS = _spec_arguments()
_IMPL_ATTR = f"{hookspecs.PROJECT_NAME}_impl"


def check_hook_overrides(cls: type) -> None:
    """Refuse a class whose override of a hook would be ignored or called with the wrong arguments."""
    for name, spec_args in HOOK_ARGUMENTS.items():
        if name not in cls.__dict__:
            continue
        member = cls.__dict__[name]
        function = getattr(member, "__func__", member)
        if not hasattr(function, _IMPL_ATTR):
            raise HookImplementationError(
                f"{cls.__module__}.{cls.__qualname__}.{name} overrides the hook {name!r} without "
                f"@stratagem.hookimpl, so pluggy would silently keep calling the inherited implementation. "
                f"Decorate it with @hookimpl (from stratagem import hookimpl)."
            )
        params = list(inspect.signature(function).parameters.values())
        names = [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        extra = [n for n in names if n not in spec_args]
        if extra:
            raise HookImplementationError(
                f"{cls.__module__}.{cls.__qualname__}.{name}{inspect.signature(function)} takes "
                f"{extra}, which the hook spec {name}{tuple(spec_args)} does not offer. An implementation may "
                f"take any subset of the spec's arguments, by the same names."
            )


class HookObject:
    """A class whose hook overrides are checked at definition (:func:`check_hook_overrides`)."""

    #: What the registry builds it as (``"strategy"``, ``"launcher"``): set by the base class of each kind.
    plugin_kind: str = ""
    #: The name the registry created this object under (empty for an instance built by hand).
    registered_name: str | None = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_hook_overrides(cls)

    @property
    def name(self) -> str:
        return self.registered_name or type(self).__name__
