"""The options of the DeepSpeed strategies (names as in the seeds), checked when the strategy is built.

Two ways to configure, as in the seeds: the named options below, which become DeepSpeed's config
(:mod:`stratagem_deepspeed._sections` writes it), or ``config``, a whole DeepSpeed config (a dict or a JSON
file), in which case the named options are not applied and setting one is refused. Either way the strategy adds
what stratagem owns: the precision section from ``precision=``, one micro-batch per ``engine.step``
(stratagem's loop accumulates), and no periodic DeepSpeed logging unless ``logging_level`` asks for it.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from stratagem_deepspeed import _options as o
from stratagem_deepspeed import _rules

#: The environment variable naming a DeepSpeed JSON config when the strategy is given none.
CONFIG_ENV = "STRATAGEM_DEEPSPEED_CONFIG"
STAGES = o.STAGES
load_config = o.load_config


def _int(name: str, minimum: int, example: str) -> Any:
    return o.integer(name, minimum, example)


@attrs.frozen(kw_only=True)
class DeepSpeedConfig:
    """The DeepSpeed strategies' options. Defaults are DeepSpeed's own unless said otherwise.

    ZeRO:

    :param stage: 1 partitions the optimizer state, 2 also the gradients, 3 also the parameters (0: DeepSpeed's
        engine without partitioning).
    :param allgather_bucket_size: elements gathered at a time after the step (stages 1-2).
    :param reduce_bucket_size: elements reduced at a time during backward.
    :param contiguous_gradients: copy gradients into one buffer as they are reduced (less fragmentation).
    :param overlap_comm: reduce gradients while backward still runs.
    :param sub_group_size: stage 3 steps the optimizer over groups of this many elements (with NVMe offload,
        the unit swapped in and out).

    Offload (ZeRO-Offload and ZeRO-Infinity):

    :param offload_optimizer: keep the optimizer state out of accelerator memory and step it on the CPU.
    :param offload_parameters: keep the parameters out of accelerator memory between uses (stage 3).
    :param offload_optimizer_device: ``"cpu"`` (host memory) or ``"nvme"`` (files under ``nvme_path``).
    :param offload_params_device: ``"cpu"`` or ``"nvme"``.
    :param remote_device: where ``zero.Init`` puts each parameter's partition while the model is built (stage
        3): ``None`` follows ``offload_params_device`` when the parameters are offloaded, else the device.
    :param nvme_path: an existing, writable directory on a local NVMe drive; DeepSpeed writes its swap files
        under it. Required by an ``"nvme"`` device, refused without one.
    :param params_buffer_count: parameter offload to NVMe: buffers in the swap pool.
    :param params_buffer_size: parameter offload to NVMe: elements per buffer (at least the largest parameter).
    :param max_in_cpu: parameter offload to NVMe: elements kept in host memory.
    :param optimizer_buffer_count: optimizer offload to NVMe: buffers in the swap pool (at least the number of
        tensors per parameter the optimizer keeps: 4 for Adam).
    :param block_size: NVMe I/O: bytes per request.
    :param queue_depth: NVMe I/O: requests in flight.
    :param single_submit: NVMe I/O: submit requests one by one instead of in batches.
    :param overlap_events: NVMe I/O: overlap submitting requests with waiting for completions.
    :param thread_count: NVMe I/O: threads per request (DeepSpeed's ``intra_op_parallelism``).
    :param pin_memory: offload into page-locked host memory (``None``: on CUDA, not on CPU).

    Activation checkpointing (``deepspeed.checkpointing.checkpoint`` in the model):

    :param partition_activations: keep each checkpointed input partitioned across model-parallel ranks (with
        no model parallelism: one flat copy, detached from the input). ``None``: the same as
        ``cpu_checkpointing``, since DeepSpeed documents CPU checkpointing as moving partitioned activations.
    :param cpu_checkpointing: keep checkpointed inputs in host memory until backward.
    :param contiguous_memory_optimization: copy checkpointed inputs into preallocated buffers (needs
        ``partition_activations`` and ``number_checkpoints``).
    :param number_checkpoints: checkpoint calls per forward, which sizes those buffers.
    :param synchronize_checkpoint_boundary: synchronise the device at the start and end of each checkpoint.

    fp16 loss scaling (``precision="16-mixed"`` only; refused with any other precision):

    :param loss_scale: a fixed loss scale; 0 scales dynamically.
    :param initial_scale_power: the dynamic scale starts at 2**this.
    :param loss_scale_window: steps without overflow before the dynamic scale grows.
    :param hysteresis: overflows tolerated before the dynamic scale shrinks.
    :param min_loss_scale: the dynamic scale's floor (an integer, as DeepSpeed 0.19 requires).

    Whole config and logging:

    :param config: a whole DeepSpeed config (a dict or a JSON file's path). The named options are then not
        applied (the config says everything), and setting one besides is refused; an ``optimizer`` section
        (and a ``scheduler``) replace ``configure_optimizers``.
    :param logging_level: the level of DeepSpeed's logger; ``logging.INFO`` or lower also has DeepSpeed print
        its throughput every 10 steps (the config's ``steps_per_print``, if it has one).
    :param logging_batch_size_per_gpu: samples per process per step, from which DeepSpeed computes that
        throughput (its ``train_micro_batch_size_per_gpu``; stratagem default 1).
    """

    stage: int = attrs.field(default=2, converter=o.stage)
    allgather_bucket_size: int = attrs.field(default=200_000_000, converter=o.bucket)
    reduce_bucket_size: int = attrs.field(default=200_000_000, converter=o.bucket)
    contiguous_gradients: bool = attrs.field(default=True, validator=o.flag("contiguous_gradients"))
    overlap_comm: bool = attrs.field(default=True, validator=o.flag("overlap_comm"))
    sub_group_size: int = attrs.field(default=1_000_000_000, converter=_int("sub_group_size", 1, "1e9"))

    offload_optimizer: bool = attrs.field(default=False, validator=o.flag("offload_optimizer"))
    offload_parameters: bool = attrs.field(default=False, validator=o.flag("offload_parameters"))
    offload_optimizer_device: str = attrs.field(default="cpu", converter=o.device("offload_optimizer_device"))
    offload_params_device: str = attrs.field(default="cpu", converter=o.device("offload_params_device"))
    remote_device: str | None = attrs.field(default=None, converter=o.remote_device)
    nvme_path: str | None = attrs.field(default=None, converter=o.path)
    params_buffer_count: int = attrs.field(default=5, converter=_int("params_buffer_count", 1, "5"))
    params_buffer_size: int = attrs.field(default=100_000_000, converter=_int("params_buffer_size", 1, "1e8"))
    max_in_cpu: int = attrs.field(default=1_000_000_000, converter=_int("max_in_cpu", 0, "1e9"))
    optimizer_buffer_count: int = attrs.field(default=4, converter=_int("optimizer_buffer_count", 1, "4"))
    block_size: int = attrs.field(default=1_048_576, converter=_int("block_size", 1, "1048576"))
    queue_depth: int = attrs.field(default=8, converter=_int("queue_depth", 1, "8"))
    single_submit: bool = attrs.field(default=False, validator=o.flag("single_submit"))
    overlap_events: bool = attrs.field(default=True, validator=o.flag("overlap_events"))
    thread_count: int = attrs.field(default=1, converter=_int("thread_count", 1, "1"))
    pin_memory: bool | None = attrs.field(
        default=None, validator=o.optional_flag("pin_memory", "pinned on CUDA, not on CPU")
    )

    partition_activations: bool | None = attrs.field(
        default=None, validator=o.optional_flag("partition_activations", "same as cpu_checkpointing")
    )
    cpu_checkpointing: bool = attrs.field(default=False, validator=o.flag("cpu_checkpointing"))
    contiguous_memory_optimization: bool = attrs.field(
        default=False, validator=o.flag("contiguous_memory_optimization")
    )
    number_checkpoints: int | None = attrs.field(
        default=None, converter=o.optional_positive("number_checkpoints")
    )
    synchronize_checkpoint_boundary: bool = attrs.field(
        default=False, validator=o.flag("synchronize_checkpoint_boundary")
    )

    loss_scale: float = attrs.field(default=0.0, converter=o.number("loss_scale", positive=False))
    initial_scale_power: int = attrs.field(default=16, converter=_int("initial_scale_power", 0, "16"))
    loss_scale_window: int = attrs.field(default=1000, converter=_int("loss_scale_window", 1, "1000"))
    hysteresis: int = attrs.field(default=2, converter=_int("hysteresis", 1, "2"))
    min_loss_scale: int = attrs.field(default=1, converter=_int("min_loss_scale", 1, "1"))

    config: dict[str, Any] | None = attrs.field(default=None, converter=o.load_config, repr=False)
    logging_level: int = attrs.field(default=logging.WARNING, converter=o.logging_level)
    logging_batch_size_per_gpu: int = attrs.field(default=1, converter=o.logging_batch_size)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> DeepSpeedConfig:
        """Build from keyword options; an unknown name is refused with the closest accepted one."""
        _rules.check_names(options, option_names())
        return cls(**options)

    def __attrs_post_init__(self) -> None:
        if self.config is not None:
            _rules.check_user_config(self)
        else:
            _rules.check_named_options(self)

    def non_default(self) -> dict[str, Any]:
        """The options whose value differs from the default."""
        return {
            a.name: getattr(self, a.name)
            for a in attrs.fields(type(self))
            if a.name != "config" and getattr(self, a.name) != a.default
        }

    @property
    def zero_stage(self) -> int:
        if self.config is not None:
            return int(self.config.get("zero_optimization", {}).get("stage", 0))
        return self.stage

    @property
    def offloads_optimizer(self) -> bool:
        if self.config is None:
            return self.offload_optimizer
        device = self.config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        return device not in (None, "none")

    @property
    def config_optimizer(self) -> str | None:
        """The type named by the user config's ``optimizer`` section, if it has one."""
        section = (self.config or {}).get("optimizer")
        if section is None:
            return None
        return str(section.get("type", "?")) if isinstance(section, dict) else repr(section)

    @property
    def config_scheduler(self) -> str | None:
        section = (self.config or {}).get("scheduler")
        if section is None:
            return None
        return str(section.get("type", "?")) if isinstance(section, dict) else repr(section)

    def deepspeed_config(
        self, precision: str, accelerator: str = "cpu", model_numel: int | None = None
    ) -> dict[str, Any]:
        """The config passed to ``deepspeed.initialize`` for this precision and accelerator.

        :param model_numel: the model's parameter count; the named options' buckets are capped at it (a bucket
            larger than the model holds nothing more, but DeepSpeed allocates it whole).
        """
        from stratagem_deepspeed._sections import build

        return build(self, precision, accelerator, model_numel)


def option_names() -> list[str]:
    return [a.name for a in attrs.fields(DeepSpeedConfig)]
