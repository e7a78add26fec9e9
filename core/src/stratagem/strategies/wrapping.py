"""Manual wrapping (``stratagem.wrap``) and materialisation of modules built on the meta device."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

M = TypeVar("M")

_wrapper: contextvars.ContextVar[Callable[[object], object] | None] = contextvars.ContextVar(
    "stratagem_wrapper", default=None
)
_allocate_only: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "stratagem_allocate_only", default=False
)


def wrap(module: M) -> M:
    """Shard ``module`` now if called inside the strategy's ``model_sharded_context``; otherwise return it as is.

    Use it in ``configure_model`` to choose by hand which submodules become their own shard units.
    """
    function = _wrapper.get()
    return module if function is None else function(module)  # type: ignore[return-value]


@contextlib.contextmanager
def wrapping_with(
    function: Callable[[object], object], torch_wrap_options: str | None = None
) -> Iterator[None]:
    """For strategies: inside this block, :func:`wrap` calls ``function(module)``.

    With ``torch_wrap_options`` (the class whose options a unit takes, named in the error), torch's own
    ``torch.distributed.fsdp.wrap.wrap(module)`` (the import of code written for FSDP1) calls it too, and
    refuses per-module FSDP1 arguments: every unit takes the strategy's options.
    """
    token = _wrapper.set(function)
    try:
        if torch_wrap_options is None:
            yield
            return
        from torch.distributed.fsdp.wrap import enable_wrap

        def torch_wrap(module: object, **overrides: object) -> object:
            if overrides:
                from stratagem.errors import ConfigurationError

                raise ConfigurationError(
                    f"torch.distributed.fsdp.wrap.wrap({type(module).__name__}, "
                    f"{', '.join(f'{k}=...' for k in sorted(overrides))}): per-module FSDP1 arguments have no "
                    f"meaning under FSDP2, which shards every unit with the strategy's options. Call wrap(module) "
                    f"or stratagem.wrap(module), and set the options on {torch_wrap_options}(...)."
                )
            return function(module)

        with enable_wrap(wrapper_cls=torch_wrap):
            yield
    finally:
        _wrapper.reset(token)


@contextlib.contextmanager
def allocating_only() -> Iterator[None]:
    """Inside this block, a model built on the meta device is materialised without being initialised: its
    weights are read from a checkpoint right after (``init_weights``), so drawing them first is wasted, and
    modules without ``reset_parameters`` (a ``transformers`` RMSNorm) need none."""
    token = _allocate_only.set(True)
    try:
        yield
    finally:
        _allocate_only.reset(token)


def initializing() -> bool:
    """Whether a strategy that materialises a meta model should initialise it (``reset_parameters``); false
    inside :func:`allocating_only`, where it only allocates (``to_empty``)."""
    return not _allocate_only.get()


def has_meta_tensors(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (built under ``empty_init=True``
    and not materialised yet)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def shared_parameters(module: torch.nn.Module) -> list[tuple[str, str]]:
    """``(alias, first name)`` of each parameter registered under several names (tied embeddings)."""
    first: dict[int, str] = {}
    shared = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            shared.append((name, first[id(param)]))
        else:
            first.setdefault(id(param), name)
    return shared


def retie(module: torch.nn.Module, shared: list[tuple[str, str]]) -> None:
    """Make each alias the same parameter as its first name again: ``to_empty`` gives every name its own."""
    for alias, name in shared:
        owner, _, attribute = alias.rpartition(".")
        module.get_submodule(owner)._parameters[attribute] = module.get_parameter(name)


def materialize_meta(module: torch.nn.Module, device: torch.device | str) -> None:
    """Allocate meta parameters and buffers on ``device`` and initialise them with ``reset_parameters``.

    Works on sharded modules too: ``to_empty`` allocates only the local shards. A submodule with meta tensors
    but no ``reset_parameters`` cannot be initialised and is an error rather than silent garbage.
    """
    import torch

    if not has_meta_tensors(module):
        return
    shared = shared_parameters(module)
    module.to_empty(device=device)
    retie(module, shared)
    if not initializing():
        return
    uninitialised = []
    with torch.no_grad():
        for name, sub in module.named_modules():
            own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
            if not own:
                continue
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
            else:
                uninitialised.append(name or type(sub).__name__)
    if uninitialised:
        from stratagem.errors import ConfigurationError

        raise ConfigurationError(
            f"Modules {uninitialised} were built with empty_init=True (meta device) but have no "
            "reset_parameters() to initialise them. Add reset_parameters(), or build them with empty_init=False."
        )
