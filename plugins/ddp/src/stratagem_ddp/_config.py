"""The options of the ``ddp`` strategies, checked when the strategy is built rather than at the first step."""

from __future__ import annotations

import datetime
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from stratagem.errors import ConfigurationError

#: Short module names used in torch's documentation of communication hooks (``default.fp16_compress_hook``).
HOOK_MODULES = {
    "default": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "default_hooks": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "powerSGD": "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "powerSGD_hook": "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "post_localSGD": "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook",
    "post_localSGD_hook": "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook",
    "quantization": "torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks",
    "quantization_hooks": "torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks",
}

#: DistributedDataParallel arguments the strategy sets itself, and why they cannot be passed through.
MANAGED_DDP_ARGUMENTS = {
    "module": "the strategy wraps the model given to Engine.setup()",
    "device_ids": "the strategy uses this rank's device",
    "output_device": "the strategy uses this rank's device",
    "process_group": "the strategy replicates over the process group it joined (process_group_backend=...)",
    "device_mesh": "the strategy replicates over the process group it joined",
}

BACKENDS = (None, "gloo", "nccl", "mpi", "cpu:gloo,cuda:nccl")


def _fail(field: str, value: Any, advice: str) -> ConfigurationError:
    return ConfigurationError(f"DDPStrategy({field}={value!r}): {advice}")


# -------------------------------------------------------------------------------------------------
# converters
# -------------------------------------------------------------------------------------------------


def resolve_callable(field: str) -> Callable[[Any], Any]:
    """A converter turning ``"default.fp16_compress_hook"`` or ``"pkg.module:attr"`` into the function."""

    def convert(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if ":" in value:
            module_name, _, attr = value.partition(":")
        else:
            short, _, attr = value.rpartition(".")
            module_name = HOOK_MODULES.get(short, "")
            if not module_name:
                raise _fail(
                    field,
                    value,
                    f"name a hook as '<module>.<function>' with <module> one of {sorted(set(HOOK_MODULES))} "
                    "(e.g. 'default.fp16_compress_hook'), as 'pkg.module:function', or pass the function.",
                )
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise _fail(field, value, f"cannot import it ({error}).") from None

    return convert


def to_timedelta(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.timedelta(seconds=value)
    return value


def to_dict(value: Any) -> dict[str, Any]:
    return dict(value or {})


# -------------------------------------------------------------------------------------------------
# validators
# -------------------------------------------------------------------------------------------------


def _is_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(attribute.name, value, "give True or False.")


def _is_callable_or_none(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not callable(value):
        raise _fail(
            attribute.name,
            value,
            "give a function such as torch.distributed.algorithms.ddp_comm_hooks.default_hooks."
            "fp16_compress_hook, or its name 'default.fp16_compress_hook'.",
        )


def _is_period(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(
            attribute.name, value, "give a whole number of optimizer steps >= 1 between model averages."
        )


def _is_backend(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in BACKENDS:
        raise _fail(
            attribute.name, value, "use 'gloo' (CPU), 'nccl' (CUDA), or None for the cluster's default."
        )


def _is_timeout(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, datetime.timedelta) or value.total_seconds() <= 0:
        raise _fail(attribute.name, value, "give a positive number of seconds or a datetime.timedelta.")


def ddp_parameters() -> dict[str, inspect.Parameter]:
    """DistributedDataParallel's keyword arguments in the installed torch."""
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {name: p for name, p in params.items() if name != "self"}


def _are_ddp_arguments(instance: Any, attribute: attrs.Attribute, value: dict[str, Any]) -> None:
    valid = ddp_parameters()
    own = {f.name for f in attrs.fields(type(instance))} - {"ddp_kwargs"}
    for name, given in value.items():
        if name in own:
            raise _fail(name, given, f"this is a DDPStrategy option: pass {name}=... directly.")
        if name in MANAGED_DDP_ARGUMENTS:
            raise _fail(name, given, f"not accepted: {MANAGED_DDP_ARGUMENTS[name]}.")
        if name not in valid:
            passable = sorted(set(valid) - set(MANAGED_DDP_ARGUMENTS) - own)
            raise _fail(
                name,
                given,
                "neither a DDPStrategy option nor an argument of torch.nn.parallel.DistributedDataParallel. "
                f"DDPStrategy options: {sorted(own)}; DistributedDataParallel arguments passed through: "
                f"{passable}.",
            )


# -------------------------------------------------------------------------------------------------
# the configuration
# -------------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class DDPConfig:
    """Options of :class:`~stratagem_ddp.DDPStrategy`.

    :param static_graph: the model uses the same parameters in every step; DDP can then plan its
        communication once (and tolerates unused parameters and reentrant checkpointing).
    :param gradient_as_bucket_view: gradients are views into DDP's communication buckets (less memory and no
        copy; do not ``detach_()`` gradients).
    :param find_unused_parameters: look for parameters that took no part in a step (slower; needed only when
        the set of used parameters changes from step to step).
    :param ddp_comm_hook: a communication hook replacing the all-reduce of gradients (a function, or a name
        such as ``"default.fp16_compress_hook"``).
    :param ddp_comm_state: the hook's state (for example a ``PowerSGDState`` or ``PostLocalSGDState``);
        ``None`` means the default process group for torch's default hooks.
    :param ddp_comm_wrapper: a wrapper applied to the hook, such as ``default.fp16_compress_wrapper``.
    :param model_averaging_period: with post-local SGD, average the parameters across all ranks every this
        many optimizer steps (after the hook state's ``start_localSGD_iter`` warm-up steps).
    :param process_group_backend: ``gloo``, ``nccl``, or ``None`` for the cluster's default.
    :param timeout: the process-group timeout (seconds or a ``timedelta``), or ``None`` for the engine's.
    :param ddp_kwargs: further keyword arguments of ``DistributedDataParallel`` (``bucket_cap_mb``,
        ``broadcast_buffers``, ...), checked against the installed torch.
    """

    static_graph: bool = attrs.field(default=False, validator=_is_bool)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=_is_bool)
    find_unused_parameters: bool = attrs.field(default=False, validator=_is_bool)
    ddp_comm_hook: Callable[..., Any] | None = attrs.field(
        default=None, converter=resolve_callable("ddp_comm_hook"), validator=_is_callable_or_none
    )
    ddp_comm_state: Any = attrs.field(default=None)
    ddp_comm_wrapper: Callable[..., Any] | None = attrs.field(
        default=None, converter=resolve_callable("ddp_comm_wrapper"), validator=_is_callable_or_none
    )
    model_averaging_period: int | None = attrs.field(default=None, validator=_is_period)
    process_group_backend: str | None = attrs.field(default=None, validator=_is_backend)
    timeout: datetime.timedelta | None = attrs.field(
        default=None, converter=to_timedelta, validator=_is_timeout
    )
    ddp_kwargs: Mapping[str, Any] = attrs.field(factory=dict, converter=to_dict, validator=_are_ddp_arguments)

    def __attrs_post_init__(self) -> None:
        # A wrapper or a state means nothing without the hook they belong to; silently training with plain
        # all-reduce instead would hide the mistake until someone profiles the run.
        if self.ddp_comm_hook is None:
            if self.ddp_comm_wrapper is not None:
                raise _fail(
                    "ddp_comm_wrapper",
                    self.ddp_comm_wrapper,
                    "a wrapper modifies a communication hook; also pass ddp_comm_hook=... "
                    "(e.g. powerSGD.powerSGD_hook).",
                )
            if self.ddp_comm_state is not None:
                raise _fail(
                    "ddp_comm_state",
                    self.ddp_comm_state,
                    "a state is handed to a communication hook; also pass ddp_comm_hook=...",
                )
        self._check_post_local_sgd()

    def _check_post_local_sgd(self) -> None:
        # Post-local SGD stops all-reducing gradients after its warm-up; without periodic model averaging the
        # replicas would drift apart for good. Conversely, averaging needs the hook's warm-up step count.
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd

        uses_state = isinstance(self.ddp_comm_state, post_local_sgd.PostLocalSGDState)
        uses_hook = self.ddp_comm_hook is post_local_sgd.post_localSGD_hook
        if uses_hook and not uses_state:
            raise _fail(
                "ddp_comm_state",
                self.ddp_comm_state,
                "post_localSGD_hook needs ddp_comm_state=PostLocalSGDState(process_group=None, subgroup=None, "
                "start_localSGD_iter=...).",
            )
        if uses_state and self.model_averaging_period is None:
            raise _fail(
                "model_averaging_period",
                None,
                "post-local SGD (a PostLocalSGDState) needs model_averaging_period=N to average the replicas "
                "every N optimizer steps.",
            )
        if self.model_averaging_period is not None and not (uses_state and uses_hook):
            raise _fail(
                "model_averaging_period",
                self.model_averaging_period,
                "model averaging belongs to post-local SGD: also pass ddp_comm_hook=post_localSGD.post_localSGD_hook "
                "and ddp_comm_state=post_localSGD.PostLocalSGDState(...).",
            )

    @property
    def post_local_sgd(self) -> bool:
        return self.model_averaging_period is not None

    def ddp_arguments(self) -> dict[str, Any]:
        """The keyword arguments for ``DistributedDataParallel`` besides the module and devices."""
        return {
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "find_unused_parameters": self.find_unused_parameters,
            **self.ddp_kwargs,
        }
