"""Which submodules a policy selects: for ``auto_wrap_policy`` (own ``fully_shard`` unit) and
``activation_checkpointing_policy`` (recomputed in backward).

Every form the seeds show is accepted and turned into one :class:`Policy`:

- a set (list, tuple) of module classes, or one class: ``{Block}``;
- a callable ``(module) -> bool``;
- an FSDP1 functional policy ``(module, recurse, nonwrapped_numel) -> bool``, such as
  ``functools.partial(size_based_auto_wrap_policy, min_num_params=100)``, run with FSDP1's bottom-up
  semantics (a module is asked with the parameter count not already claimed by selected children);
- an FSDP1 policy object from ``torch.distributed.fsdp.wrap`` (``ModuleWrapPolicy``, ``CustomPolicy``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

_FORMS = (
    "a set of module classes ({Block}), a callable (module) -> bool, an FSDP1 functional policy such as "
    "functools.partial(size_based_auto_wrap_policy, min_num_params=100), or a policy object from "
    "torch.distributed.fsdp.wrap (ModuleWrapPolicy, CustomPolicy)"
)


@attrs.frozen
class Policy:
    """A normalised policy; :meth:`select` gives the chosen submodules of a root, never the root itself."""

    kind: str  # "classes" | "predicate" | "legacy_function" | "legacy_object"
    value: Any
    description: str

    def select(self, root: torch.nn.Module) -> list[torch.nn.Module]:
        """The selected submodules in ``root.modules()`` order (parents before their children)."""
        match self.kind:
            case "classes":
                chosen = {id(m) for m in root.modules() if isinstance(m, tuple(self.value))}
            case "predicate":
                chosen = {id(m) for m in root.modules() if bool(self.value(m))}
            case "legacy_function":
                chosen = _run_legacy_function(root, self.value)
            case "legacy_object":
                chosen = {id(m) for m in self.value._run_policy(root, set(), {})}
            case _:
                raise ValueError(f"Policy kind {self.kind!r} is unknown; use one of {_FORMS}.")
        return [m for m in root.modules() if m is not root and id(m) in chosen]

    def select_outermost(self, root: torch.nn.Module) -> list[torch.nn.Module]:
        """Like :meth:`select`, without modules nested in another selected one (for checkpointing)."""
        selected = self.select(root)
        ids = {id(m) for m in selected}
        nested = {id(d) for m in selected for d in m.modules() if d is not m and id(d) in ids}
        return [m for m in selected if id(m) not in nested]


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _run_legacy_function(root: torch.nn.Module, policy: Callable[..., bool]) -> set[int]:
    """FSDP1's recursive auto-wrap: descend where ``policy(recurse=True)``, select bottom-up where
    ``policy(recurse=False, nonwrapped_numel=<parameters not in selected children>)``."""
    chosen: set[int] = set()

    def visit(module: torch.nn.Module) -> int:
        total = _numel(module)
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return 0
        claimed = sum(visit(child) for child in module.children())
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=total - claimed):
            chosen.add(id(module))
            return total
        return claimed

    visit(root)
    return chosen


def _is_legacy_function(function: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in params and "nonwrapped_numel" in params


def to_policy(field: str) -> Callable[[Any], Policy | None]:
    """An attrs converter for a policy field: any accepted form becomes a :class:`Policy` (or ``None``)."""

    def convert(value: Any) -> Policy | None:
        import torch

        if value is None or isinstance(value, Policy):
            return value
        if isinstance(value, type):
            value = {value}
        if isinstance(value, (set, frozenset, list, tuple)):
            return _class_policy(field, value, torch.nn.Module)
        from torch.distributed.fsdp.wrap import _Policy

        if isinstance(value, _Policy):
            return Policy("legacy_object", value, type(value).__name__)
        if callable(value):
            name = getattr(getattr(value, "func", value), "__name__", type(value).__name__)
            if _is_legacy_function(value):
                return Policy("legacy_function", value, f"{name} (FSDP1 functional policy)")
            return Policy("predicate", value, name)
        raise ConfigurationError(f"FSDPStrategy({field}={value!r}): give {_FORMS}.")

    return convert


def _class_policy(field: str, classes: Iterable[Any], module_type: type) -> Policy:
    classes = list(classes)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, module_type))]
    if bad or not classes:
        raise ConfigurationError(
            f"FSDPStrategy({field}={classes!r}): "
            + (f"{bad!r} are not torch.nn.Module subclasses; " if bad else "the set is empty; ")
            + f"give {_FORMS}."
        )
    return Policy("classes", frozenset(classes), "{" + ", ".join(sorted(c.__name__ for c in classes)) + "}")
