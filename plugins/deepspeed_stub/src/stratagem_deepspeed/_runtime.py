"""Importing DeepSpeed for a stratagem process, and the pieces of its engine the strategy talks to.

DeepSpeed picks its accelerator when first imported (``DS_ACCELERATOR``), so the import waits until the
strategy knows the cluster's device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from typing import Any

from stratagem.errors import ConfigurationError

#: The op DeepSpeed compiles for shared-memory all-reduce on CPU; it is only used when DeepSpeed's own
#: launcher sets LOCAL_SIZE, never under torch's elastic agent.
SHM_OP = "deepspeed_shm_comm"


def import_deepspeed(accelerator: str, logging_level: int) -> Any:
    """``deepspeed``, imported for ``accelerator`` (``cpu`` or ``cuda``), its logger at ``logging_level``."""
    wanted = "cpu" if accelerator == "cpu" else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", wanted)
    try:
        import deepspeed
    except ImportError as error:
        raise ConfigurationError(
            f"The DeepSpeed strategies need the deepspeed package ({error}). "
            "Install it: pip install 'stratagem-deepspeed[deepspeed]'."
        ) from error
    from deepspeed.accelerator import get_accelerator

    actual = get_accelerator().device_name()
    if actual != wanted:
        raise ConfigurationError(
            f"deepspeed runs on {actual!r} here (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r}), but this "
            f"run's accelerator is {accelerator!r}. Unset DS_ACCELERATOR or set it to {wanted!r}."
        )
    logging.getLogger("DeepSpeed").setLevel(logging_level)
    # ZeRO's partitioned parameters and gradients move through torch.distributed.all_gather_into_tensor and
    # reduce_scatter_tensor, which torch deprecates in favour of *_single under the same semantics: DeepSpeed's
    # calls, not the user's, so the FutureWarning (once per rank) tells them nothing they can change.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
        module=r"torch\.distributed\.c10d_logger",
    )
    if wanted == "cpu" and "LOCAL_SIZE" not in os.environ:
        # Every DeepSpeed communication backend otherwise compiles (about 30 s the first time) and maps a
        # shared-memory all-reduce that this launcher never uses.
        deepspeed.ops.__compatible_ops__[SHM_OP] = False
    return deepspeed


def zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage()) if engine.zero_optimization() else 0


def base_optimizer(engine: Any) -> Any:
    """The torch optimizer that steps the fp32 partitions (the user's optimizer under ZeRO)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer) if zero_stage(engine) else optimizer


def flat_partitions(engine: Any) -> list[Any]:
    """This rank's fp32 master partitions, one per group (stages 1-2) or sub-group (stage 3)."""
    optimizer = engine.optimizer
    if zero_stage(engine) == 3:
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)


def partition_index(engine: Any, param: Any, group_index: int) -> int:
    """The index in :func:`flat_partitions` that holds ``param``'s master values."""
    if zero_stage(engine) == 3:
        optimizer = engine.optimizer
        return int(optimizer.grad_position[optimizer.get_param_id(param)][0])
    return group_index


def global_grad_norm(engine: Any) -> float:
    """The total 2-norm of the reduced gradients, as DeepSpeed will compute it in ``step``."""
    optimizer = engine.optimizer
    if zero_stage(engine) == 3:
        # One norm per sub-group; combined as DeepSpeed combines them in step().
        norm = math.sqrt(sum(float(n) ** 2 for n in optimizer._get_norm_groups()))
    else:
        norm = float(optimizer.scaled_global_norm())
    return norm / float(getattr(optimizer, "loss_scale", 1.0) or 1.0)


@contextlib.contextmanager
def gathered(params: list[Any], modifier_rank: int | None = None):
    """Stage-3 parameters whole inside the block (a no-op for parameters that are not partitioned)."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def configure_activation_checkpointing(deepspeed: Any, settings: dict[str, Any]) -> None:
    """Set DeepSpeed's activation checkpointing (what ``deepspeed.checkpointing.checkpoint`` in a model does)
    from a config's ``activation_checkpointing`` settings.

    Called for every DeepSpeed strategy, with DeepSpeed's defaults where the config says nothing: the settings
    are module-wide in DeepSpeed, so a run must not inherit those of an earlier one in the same process.
    """
    # Contiguous buffers of an earlier run hold its checkpoints; reset() frees them while its setting is on.
    deepspeed.checkpointing.reset()
    deepspeed.checkpointing.configure(
        None,
        partition_activations=bool(settings["partition_activations"]),
        contiguous_checkpointing=bool(settings["contiguous_memory_optimization"]),
        num_checkpoints=settings["number_checkpoints"],
        checkpoint_in_cpu=bool(settings["cpu_checkpointing"]),
        synchronize=bool(settings["synchronize_checkpoint_boundary"]),
        profile=bool(settings["profile"]),
    )


def check_async_io() -> None:
    """NVMe offload runs through DeepSpeed's asynchronous I/O op, which it compiles against libaio."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible():
        raise ConfigurationError(
            "An 'nvme' offload device needs DeepSpeed's asynchronous I/O op, which needs libaio and its headers; "
            "they are not found here. Install them (Debian/Ubuntu: apt-get install libaio-dev; RHEL/Fedora: "
            "yum install libaio-devel), or offload to 'cpu'."
        )
