"""The options of the FSDP strategies, checked when the strategy is built rather than at the first step."""

from __future__ import annotations

import datetime
from typing import Any

import attrs

from stratagem.errors import ConfigurationError
from stratagem_fsdp._policy import Policy, to_policy

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
STATE_DICT_TYPES = ("full", "sharded")
BACKENDS = (None, "gloo", "nccl", "mpi", "cpu:gloo,cuda:nccl")
BACKWARD_PREFETCH = (None, "BACKWARD_PRE", "BACKWARD_POST")

#: FSDP1 options that FSDP2 has no use for, and why. They are accepted (so that a configuration written for
#: FSDP1 runs) with a one-time warning that says this.
NO_LONGER_APPLY = {
    "limit_all_gathers": (
        "FSDP2 always limits in-flight all-gathers: a module's all-gather waits for the previous one's "
        "buffers to be released, so there is no rate limiter to switch on or off"
    ),
    "use_orig_params": (
        "FSDP2 always keeps the original parameters (as DTensor shards) instead of flat parameters, which is "
        "what use_orig_params=True gave; use_orig_params=False cannot be had"
    ),
}
#: FSDP1 options that are not accepted at all, with what to do instead.
REFUSED = {
    "device_id": "the strategy uses this rank's device",
    "process_group": "the strategy builds its device mesh from sharding_strategy (and replicate_size/shard_size)",
    "device_mesh": "the strategy builds its device mesh from sharding_strategy (and replicate_size/shard_size)",
    "sync_module_states": (
        "build the model under engine.init_module(empty_init=True): every rank then initialises its shards "
        "from the same random stream"
    ),
    "param_init_fn": "give the modules a reset_parameters() method; it runs on each shard after materialising",
    "ignored_modules": "not supported by this strategy",
    "ignored_states": "not supported by this strategy",
}


def _fail(field: str, value: Any, advice: str) -> ConfigurationError:
    return ConfigurationError(f"FSDPStrategy({field}={value!r}): {advice}")


# -------------------------------------------------------------------------------------------------
# converters
# -------------------------------------------------------------------------------------------------


def _enum_name(value: Any) -> Any:
    # torch.distributed.fsdp.ShardingStrategy.FULL_SHARD, BackwardPrefetch.BACKWARD_PRE, ... -> their names.
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and not isinstance(value, str) else value


def to_sharding_strategy(value: Any) -> Any:
    value = _enum_name(value)
    return value.upper() if isinstance(value, str) and not value.startswith("_") else value


def to_lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def to_cpu_offload(value: Any) -> Any:
    """``True``/``False``, FSDP1's ``CPUOffload(offload_params=...)`` or FSDP2's ``CPUOffloadPolicy``."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if hasattr(value, "offload_params") and not hasattr(value, "pin_memory"):
        return bool(value.offload_params)
    return value


def to_mixed_precision(value: Any) -> Any:
    """FSDP1's ``MixedPrecision`` becomes FSDP2's ``MixedPrecisionPolicy`` with the same dtypes."""
    if value is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(value, MixedPrecisionPolicy):
        return value
    if hasattr(value, "param_dtype") and hasattr(value, "buffer_dtype"):
        if value.buffer_dtype is not None:
            import warnings

            warnings.warn(
                "FSDPStrategy(mixed_precision=MixedPrecision(buffer_dtype=...)): FSDP2 does not manage "
                "buffers, so buffer_dtype has no effect; cast buffers yourself if they must differ.",
                stacklevel=4,
            )
        return MixedPrecisionPolicy(
            param_dtype=value.param_dtype,
            reduce_dtype=value.reduce_dtype,
            # FSDP1 cast the root's inputs by default (cast_root_forward_inputs); FSDP2 casts at the root too.
            cast_forward_inputs=bool(
                getattr(value, "cast_forward_inputs", False)
                or getattr(value, "cast_root_forward_inputs", True)
            ),
        )
    return value


def to_timedelta(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.timedelta(seconds=value)
    return value


# -------------------------------------------------------------------------------------------------
# validators
# -------------------------------------------------------------------------------------------------


def _one_of(choices: tuple[Any, ...], advice: str = "") -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            shown = ", ".join(repr(c) for c in choices)
            raise _fail(attribute.name, value, f"use one of {shown}{advice}.")

    return check


def _is_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(attribute.name, value, "give True or False.")


def _is_cpu_offload(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool):
        return
    from torch.distributed.fsdp import CPUOffloadPolicy

    if not isinstance(value, CPUOffloadPolicy):
        raise _fail(
            attribute.name,
            value,
            "give True/False, torch.distributed.fsdp.CPUOffloadPolicy(), or CPUOffload().",
        )


def _is_mixed_precision(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(value, MixedPrecisionPolicy):
        raise _fail(
            attribute.name,
            value,
            "give torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...), FSDP1's "
            "MixedPrecision, or None to derive it from the precision (bf16-mixed, 16-mixed).",
        )


def _is_reshard(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1:
        raise _fail(
            attribute.name,
            value,
            "give True (free gathered parameters after forward), False (keep them until backward), a number "
            "of processes to reshard to after forward, or None for the sharding strategy's choice.",
        )


def _is_size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise _fail(attribute.name, value, "give a positive number of processes, or None.")


def _is_timeout(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not (isinstance(value, datetime.timedelta) and value.total_seconds() > 0):
        raise _fail(attribute.name, value, "give a positive number of seconds or a datetime.timedelta.")


def _is_prefetch(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _one_of(BACKWARD_PREFETCH, " (or torch.distributed.fsdp.BackwardPrefetch)")(instance, attribute, value)


# -------------------------------------------------------------------------------------------------
# the configuration
# -------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FSDPConfig:
    """Every option of :class:`~stratagem_fsdp.FSDPStrategy`, normalised and checked.

    :param auto_wrap_policy: which submodules become their own ``fully_shard`` unit (see ``_policy``).
    :param activation_checkpointing_policy: which submodules recompute their activations in backward.
    :param sharding_strategy: ``FULL_SHARD`` (reshard after forward), ``SHARD_GRAD_OP`` (keep parameters
        gathered from forward until backward), ``NO_SHARD`` (replicate), ``HYBRID_SHARD`` (shard within a
        node, replicate across nodes); FSDP1's ``ShardingStrategy`` enum is accepted too.
    :param cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (CUDA).
    :param mixed_precision: a ``MixedPrecisionPolicy``; default: derived from the precision.
    :param state_dict_type: ``full`` (one file from rank 0) or ``sharded`` (a DCP directory) by default.
    :param reshard_after_forward: overrides the sharding strategy's choice for every unit.
    :param replicate_size: HYBRID_SHARD replicas (default: the number of nodes).
    :param shard_size: HYBRID_SHARD processes per replica (default: processes per node).
    :param forward_prefetch: FSDP1's option; mapped to explicit forward prefetch of the next unit.
    :param backward_prefetch: FSDP1's option; ``BACKWARD_PRE`` is FSDP2's default, made explicit.
    :param legacy_options: FSDP1 options that no longer apply (see ``NO_LONGER_APPLY``), kept to warn once.
    """

    auto_wrap_policy: Policy | None = attrs.field(default=None, converter=to_policy("auto_wrap_policy"))
    activation_checkpointing_policy: Policy | None = attrs.field(
        default=None, converter=to_policy("activation_checkpointing_policy")
    )
    sharding_strategy: str = attrs.field(
        default="FULL_SHARD",
        converter=to_sharding_strategy,
        validator=_one_of(SHARDING_STRATEGIES, " (or torch.distributed.fsdp.ShardingStrategy)"),
    )
    cpu_offload: Any = attrs.field(default=False, converter=to_cpu_offload, validator=_is_cpu_offload)
    mixed_precision: Any = attrs.field(
        default=None, converter=to_mixed_precision, validator=_is_mixed_precision
    )
    state_dict_type: str = attrs.field(
        default="full", converter=to_lower, validator=_one_of(STATE_DICT_TYPES)
    )
    reshard_after_forward: bool | int | None = attrs.field(default=None, validator=_is_reshard)
    replicate_size: int | None = attrs.field(default=None, validator=_is_size)
    shard_size: int | None = attrs.field(default=None, validator=_is_size)
    forward_prefetch: bool = attrs.field(default=False, validator=_is_bool)
    backward_prefetch: str | None = attrs.field(default=None, converter=_enum_name, validator=_is_prefetch)
    process_group_backend: str | None = attrs.field(
        default=None, validator=_one_of(BACKENDS, " ('gloo' on CPU, 'nccl' on CUDA, None: the cluster's)")
    )
    timeout: datetime.timedelta | None = attrs.field(
        default=None, converter=to_timedelta, validator=_is_timeout
    )
    legacy_options: dict[str, Any] = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self) -> None:
        hybrid = self.sharding_strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        if not hybrid and (self.replicate_size is not None or self.shard_size is not None):
            # The sizes describe a 2D mesh; the other strategies have one dimension spanning every process.
            raise _fail(
                "replicate_size" if self.replicate_size is not None else "shard_size",
                self.replicate_size if self.replicate_size is not None else self.shard_size,
                f"only HYBRID_SHARD has a replicate and a shard dimension; sharding_strategy is "
                f"{self.sharding_strategy!r}.",
            )
        if self.sharding_strategy == "NO_SHARD" and self.reshard_after_forward not in (None, False):
            raise _fail(
                "reshard_after_forward",
                self.reshard_after_forward,
                "NO_SHARD keeps every parameter whole on every process; there is nothing to reshard.",
            )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> FSDPConfig:
        """Build from keyword options, separating FSDP1 options that no longer apply and refusing others."""
        options = dict(options)
        if "activation_checkpointing" in options:
            # Lightning's former name (seed 002's signature): a class or a list of classes.
            value = options.pop("activation_checkpointing")
            if options.get("activation_checkpointing_policy") is not None:
                raise _fail(
                    "activation_checkpointing",
                    value,
                    "it is the former name of activation_checkpointing_policy; give only that one.",
                )
            options["activation_checkpointing_policy"] = value
        legacy = {k: options.pop(k) for k in list(options) if k in NO_LONGER_APPLY}
        for name in options:
            if name in REFUSED:
                raise _fail(name, options[name], f"not accepted: {REFUSED[name]}.")
        fields = {a.name for a in attrs.fields(cls)} - {"legacy_options"}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ConfigurationError(
                f"FSDPStrategy got unknown options {unknown}. Accepted: {sorted(fields | set(NO_LONGER_APPLY))}."
            )
        return cls(**options, legacy_options=legacy)
