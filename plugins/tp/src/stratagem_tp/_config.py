"""The options of ``tp`` and ``fsdp_tp``, checked when the strategy is built; and the mesh sizes they imply."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import attrs

from stratagem.errors import ConfigurationError
from stratagem_fsdp._config import to_mixed_precision, to_timedelta
from stratagem_fsdp._policy import Policy, to_policy

STATE_DICT_TYPES = ("full", "sharded")
#: Options only the FSDP dimension of ``fsdp_tp`` gives a meaning to.
FSDP_ONLY = ("auto_wrap_policy", "reshard_after_forward", "mixed_precision")


def _fail(field: str, value: Any, advice: str) -> ConfigurationError:
    return ConfigurationError(f"TPStrategy({field}={value!r}): {advice}")


def _is_plan(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None or isinstance(value, Mapping) or callable(value):
        return
    raise _fail(
        attribute.name,
        value,
        "give a dict of module-name globs to styles ('colwise', 'rowwise', 'sequence_parallel', 'replicate' or a "
        "torch ParallelStyle), or a callable parallelize(model, mesh).",
    )


def _is_size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise _fail(attribute.name, value, "give a positive number of processes, or None.")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise _fail(attribute.name, value, f"use one of {', '.join(map(repr, choices))}.")

    return check


def _is_reshard(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise _fail(attribute.name, value, "give True, False, or None (FSDP2's default per unit).")


@attrs.frozen(kw_only=True)
class TPConfig:
    """Every option of :class:`~stratagem_tp.TPStrategy` and :class:`~stratagem_tp.FSDPTPStrategy`.

    :param plan: module-name globs to styles, or a callable ``parallelize(model, mesh)`` (see ``_plan``).
    :param tensor_parallel_size: ranks in the ``tp`` dimension. ``tp``: every rank (None or the world size);
        ``fsdp_tp``: default the ranks of one node, lowered to the largest number that divides the world size.
    :param state_dict_type: ``sharded`` (DCP directory of DTensors, the default) or ``full`` (one file).
    :param activation_checkpointing_policy: submodules whose activations backward recomputes.
    :param auto_wrap_policy: ``fsdp_tp``: submodules that become their own ``fully_shard`` unit.
    :param reshard_after_forward: ``fsdp_tp``: free gathered parameters after forward (FSDP2's default: yes).
    :param mixed_precision: ``fsdp_tp``: an FSDP2 ``MixedPrecisionPolicy`` (default: from the precision).
    """

    plan: Any = attrs.field(default=None, validator=_is_plan)
    tensor_parallel_size: int | None = attrs.field(default=None, validator=_is_size)
    state_dict_type: str = attrs.field(
        default="sharded",
        converter=lambda v: v.lower() if isinstance(v, str) else v,
        validator=_one_of(STATE_DICT_TYPES),
    )
    activation_checkpointing_policy: Policy | None = attrs.field(
        default=None, converter=to_policy("activation_checkpointing_policy")
    )
    auto_wrap_policy: Policy | None = attrs.field(default=None, converter=to_policy("auto_wrap_policy"))
    reshard_after_forward: bool | None = attrs.field(default=None, validator=_is_reshard)
    mixed_precision: Any = attrs.field(default=None, converter=to_mixed_precision)
    process_group_backend: str | None = None
    timeout: datetime.timedelta | None = attrs.field(default=None, converter=to_timedelta)


def mesh_shape(config: TPConfig, world: int, num_nodes: int, two_d: bool) -> tuple[int, int]:
    """``(dp, tp)``: the data-parallel and tensor-parallel sizes for this world."""
    asked = config.tensor_parallel_size
    if not two_d:
        if asked is not None and asked != world:
            raise ConfigurationError(
                f"tp: tensor_parallel_size={asked} with {world} processes; 'tp' splits over every process. "
                f"Use 'fsdp_tp' (FSDPTPStrategy(tensor_parallel_size={asked})) to add a data-parallel dimension."
            )
        return 1, world
    if asked is None:
        per_node = max(world // max(num_nodes, 1), 1)
        asked = max(d for d in range(1, per_node + 1) if world % d == 0)
    elif world % asked:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigurationError(
            f"fsdp_tp: tensor_parallel_size={asked} does not divide the world size {world}; the mesh is "
            f"(dp, tp) = (world / tp, tp). Use one of {divisors}."
        )
    return world // asked, asked
