"""The options of ``pp``, ``pp_fsdp`` and ``pp_fsdp_tp``, checked when the strategy is built; and the mesh
sizes they imply for a world size, checked before any process group exists."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import attrs

from stratagem.errors import ConfigurationError
from stratagem_fsdp._config import to_mixed_precision, to_timedelta
from stratagem_fsdp._policy import Policy, to_policy
from stratagem_pp import _schedules, _split

STATE_DICT_TYPES = ("full", "sharded")
#: Options of the FSDP dimension (``pp_fsdp`` and ``pp_fsdp_tp``).
FSDP_OPTIONS = ("auto_wrap_policy", "reshard_after_forward", "mixed_precision")
#: Options of the tensor-parallel dimension (``pp_fsdp_tp``).
TP_OPTIONS = ("tp_plan", "tensor_parallel_size")
#: The pipeline size of the 2-D and 3-D strategies when none is given: the smallest real pipeline.
DEFAULT_PP = 2
#: The tensor-parallel size of ``pp_fsdp_tp`` when none is given.
DEFAULT_TP = 2


def _fail(field: str, value: Any, advice: str) -> ConfigurationError:
    return ConfigurationError(f"PPStrategy({field}={value!r}): {advice}")


def _is_size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise _fail(attribute.name, value, "give a positive whole number, or None for the default.")


def _is_schedule(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in _schedules.SCHEDULES:
        raise _fail(attribute.name, value, _schedules.unknown_message(value))


def _is_pp_plan(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """``None``, a callable (of the number of stages), or a plan in one of ``_split``'s forms."""
    if value is None or (callable(value) and not isinstance(value, Mapping)):
        return
    problem = _split.form_problem(value)
    if problem:
        raise _fail(attribute.name, value, problem)


def _to_pp_plan(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def _is_tp_plan(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None or isinstance(value, Mapping) or callable(value):
        return
    raise _fail(attribute.name, value, "give a dict of module-name globs to styles (see stratagem-tp).")


def _is_reshard(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise _fail(attribute.name, value, "give True, False, or None (FSDP2's default per unit).")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise _fail(attribute.name, value, f"use one of {', '.join(map(repr, choices))}.")

    return check


@attrs.frozen(kw_only=True)
class PPConfig:
    """Every option of the pipeline strategies.

    :param pipeline_parallel_size: ranks in the ``pp`` dimension. ``pp``: every rank (None or the world size);
        ``pp_fsdp`` / ``pp_fsdp_tp``: default 2.
    :param schedule: a name of :data:`stratagem_pp.SCHEDULES` (torch's class names are accepted too).
    :param microbatches: micro-batches each batch is cut into; must divide the per-process batch. Default:
        the number of stages.
    :param stages_per_rank: stages each rank runs (virtual stages of the interleaved schedules). Default: 1
        for ``gpipe`` and ``1f1b``, 2 for the others.
    :param pp_plan: where the model splits (see ``_split``): stage beginnings, module names per stage, or a
        callable of the number of stages giving one of those; default: the model's ``pp_plan``, Hugging Face's
        ``base_model_pp_plan``, else an even split of the repeated blocks by parameter count.
    :param activation_checkpointing_policy: submodules of each stage whose activations backward recomputes.
    :param auto_wrap_policy: FSDP units of each stage (default: the stage's blocks); the stage is the root unit.
    :param reshard_after_forward: FSDP2's option for every unit. Default False (torchtitan's choice under a
        pipeline): with True each micro-batch's forward and backward gathers the parameters again.
    :param mixed_precision: an FSDP2 ``MixedPrecisionPolicy`` (default: from the precision).
    :param tp_plan: ``pp_fsdp_tp``: the tensor-parallel plan (stratagem-tp's forms); default: the model's
        ``tp_plan``.
    :param tensor_parallel_size: ``pp_fsdp_tp``: ranks in the ``tp`` dimension (default 2).
    :param state_dict_type: ``sharded`` (DCP directory, the default) or ``full`` (one file from rank 0).
    """

    pipeline_parallel_size: int | None = attrs.field(default=None, validator=_is_size)
    schedule: str = attrs.field(default="1f1b", converter=_schedules.canonical, validator=_is_schedule)
    microbatches: int | None = attrs.field(default=None, validator=_is_size)
    stages_per_rank: int | None = attrs.field(default=None, validator=_is_size)
    pp_plan: Any = attrs.field(default=None, converter=_to_pp_plan, validator=_is_pp_plan)
    activation_checkpointing_policy: Policy | None = attrs.field(
        default=None, converter=to_policy("activation_checkpointing_policy")
    )
    auto_wrap_policy: Policy | None = attrs.field(default=None, converter=to_policy("auto_wrap_policy"))
    reshard_after_forward: bool | None = attrs.field(default=None, validator=_is_reshard)
    mixed_precision: Any = attrs.field(default=None, converter=to_mixed_precision)
    tp_plan: Any = attrs.field(default=None, validator=_is_tp_plan)
    tensor_parallel_size: int | None = attrs.field(default=None, validator=_is_size)
    state_dict_type: str = attrs.field(
        default="sharded",
        converter=lambda v: v.lower() if isinstance(v, str) else v,
        validator=_one_of(STATE_DICT_TYPES),
    )
    process_group_backend: str | None = None
    timeout: datetime.timedelta | None = attrs.field(default=None, converter=to_timedelta)

    @property
    def resolved_stages_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return _schedules.default_stages_per_rank(self.schedule)

    def __attrs_post_init__(self) -> None:
        # Stages per rank against the schedule does not depend on the world size: refused as soon as written.
        # The micro-batch rules need the pipeline size, known here only if given.
        pp = self.pipeline_parallel_size
        _schedules.check_placement(self.schedule, self.resolved_stages_per_rank)
        if self.reshard_after_forward and _schedules.SCHEDULES[self.schedule].splits_backward:
            # Measured: FSDP2 frees a unit's gathered parameters between the input-gradient and the
            # weight-gradient halves of the split backward, and the weight gradients come out wrong.
            raise _fail(
                "reshard_after_forward",
                True,
                f"schedule {self.schedule!r} computes weight gradients after the rest of the backward, which needs "
                "each stage's gathered parameters kept from forward to then. Use reshard_after_forward=False "
                "(the default here) or a schedule without split backward: gpipe, 1f1b, interleaved_1f1b, "
                "looped_bfs.",
            )
        if pp is not None and self.microbatches is not None:
            _schedules.check(self.schedule, pp, self.resolved_stages_per_rank, self.microbatches)


@attrs.frozen
class MeshSizes:
    """``(pp, dp, tp)``; the mesh is built with the pipeline outermost: rank ``r`` sits at
    ``(r // (dp * tp), (r // tp) % dp, r % tp)``."""

    pp: int
    dp: int = 1
    tp: int = 1


def mesh_sizes(config: PPConfig, world: int, dims: int) -> MeshSizes:
    """The mesh for ``world`` processes: ``dims`` is 1 (``pp``), 2 (``pp_fsdp``) or 3 (``pp_fsdp_tp``)."""
    asked = config.pipeline_parallel_size
    if dims == 1:
        if asked is not None and asked != world:
            raise ConfigurationError(
                f"pp: pipeline_parallel_size={asked} with {world} processes; 'pp' puts every process in the "
                f"pipeline. Use 'pp_fsdp' (PPFSDPStrategy(pipeline_parallel_size={asked})) to shard each stage "
                "over the others."
            )
        sizes = MeshSizes(pp=world)
    else:
        pp = asked or DEFAULT_PP
        tp = (config.tensor_parallel_size or DEFAULT_TP) if dims == 3 else 1
        if world % (pp * tp):
            what = f"pipeline_parallel_size={pp}" + (f" x tensor_parallel_size={tp}" if dims == 3 else "")
            divisors = [d for d in range(1, world + 1) if world % (d * tp) == 0]
            raise ConfigurationError(
                f"{what} does not divide the world size {world}; the mesh is (pp, dp"
                + (", tp" if dims == 3 else "")
                + f") with dp = world / (pp{' x tp' if dims == 3 else ''}). Use pipeline_parallel_size in "
                f"{divisors}."
            )
        sizes = MeshSizes(pp=pp, dp=world // (pp * tp), tp=tp)
    if sizes.pp < 2:
        raise ConfigurationError(
            f"a pipeline needs at least 2 ranks in its pp dimension; this run has {sizes.pp}. Use a "
            "non-pipeline strategy (fsdp, ddp) or more processes."
        )
    return sizes


def microbatches_for(config: PPConfig, pp: int) -> int:
    return config.microbatches or pp * config.resolved_stages_per_rank


def check_for_world(config: PPConfig, sizes: MeshSizes) -> None:
    """The schedule's rules with the real pipeline size."""
    _schedules.check(
        config.schedule, sizes.pp, config.resolved_stages_per_rank, microbatches_for(config, sizes.pp)
    )


def check_batch(microbatches: int, batch_size: int) -> None:
    """Each micro-batch must be the same size, so that the mean of their mean losses is the batch's mean."""
    if batch_size % microbatches:
        fits = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
        raise ConfigurationError(
            f"microbatches={microbatches} does not divide the per-process batch of {batch_size} samples. Use "
            f"a batch size that is a multiple of {microbatches}, or microbatches in {fits}."
        )
