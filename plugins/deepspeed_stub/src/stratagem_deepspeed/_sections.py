"""The DeepSpeed config a :class:`~stratagem_deepspeed.DeepSpeedConfig` turns into, one section per function.

Key names are DeepSpeed 0.19's (``deepspeed/runtime/zero/config.py``, ``zero/offload_config.py``,
``swap_tensor/constants.py``, ``activation_checkpointing/config.py``, ``fp16``'s keys in ``runtime/config.py``).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from stratagem.errors import ConfigurationError
from stratagem_deepspeed._options import jsonable
from stratagem_deepspeed._rules import check_precision_options, uses_nvme

if TYPE_CHECKING:
    from stratagem_deepspeed._config import DeepSpeedConfig

#: Keys of a user's config that stratagem drives itself; a config that sets them otherwise is refused.
_OWNED_PRECISION_KEYS = ("fp16", "bf16", "amp", "torch_autocast")
#: DeepSpeed's activation-checkpointing keys and their defaults (activation_checkpointing/config.py).
ACTIVATION_DEFAULTS = {
    "partition_activations": False,
    "contiguous_memory_optimization": False,
    "cpu_checkpointing": False,
    "number_checkpoints": None,
    "synchronize_checkpoint_boundary": False,
    "profile": False,
}


def build(cfg: DeepSpeedConfig, precision: str, accelerator: str, model_numel: int | None) -> dict[str, Any]:
    check_precision_options(cfg, precision)
    if cfg.config is not None:
        config = _user_config(cfg.config, precision)
        config.setdefault("train_micro_batch_size_per_gpu", cfg.logging_batch_size_per_gpu)
    else:
        pin = cfg.pin_memory if cfg.pin_memory is not None else accelerator == "cuda"
        config = {
            "zero_optimization": zero_section(cfg, pin_memory=pin, cap=model_numel),
            "train_micro_batch_size_per_gpu": cfg.logging_batch_size_per_gpu,
        }
        if uses_nvme(cfg):
            config["aio"] = aio_section(cfg)
        activation = activation_section(cfg)
        if activation != ACTIVATION_DEFAULTS:
            config["activation_checkpointing"] = activation
        if precision == "16-mixed":
            config["fp16"] = fp16_section(cfg)
    _check_cpu_checkpointing(activation_settings(config), accelerator)
    config["gradient_accumulation_steps"] = 1
    # DeepSpeed prints its throughput every steps_per_print steps (0.19 defaults to never): every 10 steps when
    # its logging is asked for, else never.
    config.setdefault("steps_per_print", 10 if cfg.logging_level <= logging.INFO else 2**62)
    config.setdefault("wall_clock_breakdown", False)
    # The user's optimizer is used as given; DeepSpeed would otherwise refuse optimizers it has not
    # tested with ZeRO, and torch.optim optimizers with offload (it prefers its own compiled CPU Adam).
    # DeepSpeed clips the gradient norm at 1.0 when the config names no `gradient_clipping` (its
    # GRADIENT_CLIPPING_DEFAULT): a silent change to the user's optimization that no other strategy makes.
    # Clipping happens when asked (clip_gradients, the Trainer's gradient_clip_val), or by the user's config.
    config.setdefault("gradient_clipping", 0.0)
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    key = precision_key(precision)
    if key == "bf16":
        config["bf16"] = {**config.get("bf16", {}), "enabled": True}
    elif key == "fp16":
        config["fp16"] = {"initial_scale_power": 16, **config.get("fp16", {}), "enabled": True}
    return config


def _user_config(user: dict[str, Any], precision: str) -> dict[str, Any]:
    config = json.loads(json.dumps(user)) if jsonable(user) else dict(user)
    for key in _OWNED_PRECISION_KEYS:
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") and key != precision_key(precision):
            raise ConfigurationError(
                f"DeepSpeed config enables {key!r}, but the run's precision is {precision!r}. Set the "
                f"precision instead (precision='bf16-mixed' enables DeepSpeed's bf16, '16-mixed' its "
                "fp16) and remove the section."
            )
    return config


def zero_section(cfg: DeepSpeedConfig, pin_memory: bool, cap: int | None) -> dict[str, Any]:
    def capped(size: int) -> int:
        # DeepSpeed's stages 1-2 want bucket sizes that are multiples of 2 elements (4-byte alignment of fp16);
        # a model with an odd number of elements would otherwise fail its assertion at set-up.
        if cap is None or size <= cap:
            return size
        return max(2, cap + cap % 2)

    section: dict[str, Any] = {
        "stage": cfg.stage,
        "contiguous_gradients": cfg.contiguous_gradients,
        "overlap_comm": cfg.overlap_comm,
        "reduce_bucket_size": capped(cfg.reduce_bucket_size),
    }
    if cfg.stage in (1, 2):
        section["allgather_bucket_size"] = capped(cfg.allgather_bucket_size)
    if cfg.stage == 3:
        section["stage3_prefetch_bucket_size"] = capped(50_000_000)
        section["sub_group_size"] = cfg.sub_group_size
    if cfg.offload_optimizer:
        optimizer: dict[str, Any] = {"device": cfg.offload_optimizer_device, "pin_memory": pin_memory}
        if cfg.offload_optimizer_device == "nvme":
            optimizer.update(nvme_path=cfg.nvme_path, buffer_count=cfg.optimizer_buffer_count)
        section["offload_optimizer"] = optimizer
    if cfg.offload_parameters:
        params: dict[str, Any] = {"device": cfg.offload_params_device, "pin_memory": pin_memory}
        if cfg.offload_params_device == "nvme":
            params.update(
                nvme_path=cfg.nvme_path,
                buffer_count=cfg.params_buffer_count,
                buffer_size=cfg.params_buffer_size,
                max_in_cpu=cfg.max_in_cpu,
            )
        section["offload_param"] = params
    return section


def aio_section(cfg: DeepSpeedConfig) -> dict[str, Any]:
    return {
        "block_size": cfg.block_size,
        "queue_depth": cfg.queue_depth,
        # DeepSpeed 0.19 reads `intra_op_parallelism`; the seeds' `thread_count` key is no longer read.
        "intra_op_parallelism": cfg.thread_count,
        "single_submit": cfg.single_submit,
        "overlap_events": cfg.overlap_events,
    }


def activation_section(cfg: DeepSpeedConfig) -> dict[str, Any]:
    partition = cfg.cpu_checkpointing if cfg.partition_activations is None else cfg.partition_activations
    return {
        "partition_activations": partition,
        "contiguous_memory_optimization": cfg.contiguous_memory_optimization,
        "cpu_checkpointing": cfg.cpu_checkpointing,
        "number_checkpoints": cfg.number_checkpoints,
        "synchronize_checkpoint_boundary": cfg.synchronize_checkpoint_boundary,
        "profile": False,
    }


def activation_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The activation-checkpointing settings of a finished config (DeepSpeed's defaults where it says none)."""
    section = config.get("activation_checkpointing") or {}
    return {key: section.get(key, default) for key, default in ACTIVATION_DEFAULTS.items()}


def _check_cpu_checkpointing(settings: dict[str, Any], accelerator: str) -> None:
    # DeepSpeed 0.19 keeps an unpartitioned input "on the CPU" by moving it there and emptying the original;
    # where it is in host memory already, the move returns the original itself, and the input is lost.
    if accelerator == "cpu" and settings["cpu_checkpointing"] and not settings["partition_activations"]:
        raise ConfigurationError(
            "DeepSpeed cpu_checkpointing without partition_activations on the CPU accelerator: DeepSpeed 0.19 "
            "would lose each checkpointed input there (its copy to host memory is no copy when the input is in "
            "host memory already). Set partition_activations=True (or leave it None), or drop cpu_checkpointing: "
            "on CPU the activations are in host memory anyway."
        )


def fp16_section(cfg: DeepSpeedConfig) -> dict[str, Any]:
    return {
        "loss_scale": cfg.loss_scale,
        "initial_scale_power": cfg.initial_scale_power,
        "loss_scale_window": cfg.loss_scale_window,
        "hysteresis": cfg.hysteresis,
        "min_loss_scale": cfg.min_loss_scale,
    }


def precision_key(precision: str) -> str | None:
    return {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}.get(precision)
