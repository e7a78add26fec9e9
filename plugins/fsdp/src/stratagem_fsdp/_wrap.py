"""The steps of ``FSDPStrategy.wrap_model``, each usable and testable on its own."""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from stratagem_fsdp._policy import Policy


def is_sharded(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def has_sharded_submodule(module: torch.nn.Module) -> bool:
    return any(is_sharded(m) for m in module.modules() if m is not module)


def checkpoint_activations(model: torch.nn.Module, policy: Policy | None) -> list[torch.nn.Module]:
    """Wrap the outermost modules ``policy`` selects so that backward recomputes their activations.

    Runs before sharding: ``fully_shard`` then treats each checkpointed block (with its wrapper) as one unit.
    A model where the user applied checkpointing already (seed: ``apply_activation_checkpointing`` inside
    ``configure_model``) is left as it is. Returns the modules now checkpointed.
    """
    if policy is None or any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        return []
    chosen = policy.select_outermost(model)
    ids = {id(m) for m in chosen}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: id(m) in ids,
    )
    return chosen


def select_units(model: torch.nn.Module, policy: Policy | None) -> list[torch.nn.Module]:
    """The modules to shard as units of their own, innermost first (``fully_shard`` nests bottom-up).

    A selected module inside a checkpoint wrapper is replaced by the wrapper, so that recomputation and the
    unit's all-gather cover the same block. Modules sharded already (``stratagem.wrap``) are skipped.
    """
    if policy is None:
        return []
    wrapper_of = {
        id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)
    }
    units: list[torch.nn.Module] = []
    for module in reversed(policy.select(model)):
        module = wrapper_of.get(id(module), module)
        if module is not model and not is_sharded(module) and all(module is not u for u in units):
            units.append(module)
    return units


def shard_units(units: list[torch.nn.Module], shard_kwargs: dict[str, Any], reshard: bool | int) -> None:
    for unit in units:
        fully_shard(unit, **shard_kwargs, reshard_after_forward=reshard)


def shard_root(model: torch.nn.Module, shard_kwargs: dict[str, Any], reshard: bool | int | None) -> Any:
    """Shard the root, which takes every parameter no unit has claimed. Always done, even when every
    parameter sits in a unit: a parameter outside any unit would train unsynchronised."""
    if is_sharded(model):
        return model
    return fully_shard(model, **shard_kwargs, reshard_after_forward=reshard)


def set_prefetch(model: torch.nn.Module, forward: bool, backward: str | None) -> list[torch.nn.Module]:
    """FSDP1's ``forward_prefetch`` / ``backward_prefetch`` as FSDP2's explicit prefetch between units.

    Units are taken in the model's module order (the forward order of most models): in forward, each unit
    starts the next one's all-gather; with ``BACKWARD_PRE``, each unit starts the previous one's before its
    own gradients are computed. Returns the units in that order.
    """
    units = [m for m in model.modules() if m is not model and is_sharded(m)]
    units = [u for u in units if not any(u is not o and contains(o, u) for o in units)]
    if forward:
        for current, following in itertools.pairwise(units):
            current.set_modules_to_forward_prefetch([following])  # type: ignore[operator]
    if backward is not None:
        for current, previous in zip(units[1:], units, strict=False):
            current.set_modules_to_backward_prefetch([previous])  # type: ignore[operator]
    return units


def contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_TRUE = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def mixed_precision(precision: str, override: MixedPrecisionPolicy | None = None) -> MixedPrecisionPolicy:
    """The ``fully_shard`` policy for a precision name (``override``, the user's own policy, wins)."""
    if override is not None:
        return override
    dtype = _MIXED.get(precision)
    if dtype is not None:
        # Compute in the low precision, reduce gradients in float32: the sharded parameters and the
        # optimizer stay float32.
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    true_dtype = _TRUE.get(precision)
    if true_dtype is not None:
        # The parameters are bf16 / float16 already; the policy casts floating-point inputs to match them.
        return MixedPrecisionPolicy(param_dtype=true_dtype, reduce_dtype=true_dtype)
    return MixedPrecisionPolicy()


@contextlib.contextmanager
def without_gradient_sync(model: Any) -> Iterator[None]:
    """Gradients accumulate unsharded on each rank; the first backward after the block reduce-scatters them."""
    model.set_requires_gradient_sync(False, recurse=True)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True, recurse=True)


_warned: set[str] = set()


def warn_once(message: str, show: bool, source: str = "stratagem-fsdp") -> None:
    """Warn once per process, and only where ``show`` (rank 0), so a run prints each message once."""
    if message in _warned:
        return
    _warned.add(message)
    if show:
        warnings.warn(f"{source}: {message}", UserWarning, stacklevel=3)
