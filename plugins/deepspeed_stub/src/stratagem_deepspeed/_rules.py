"""Rules between the DeepSpeed strategies' options. Each says why it exists: an option that would silently do
nothing (a tuning knob for an NVMe swap that is not configured) is refused with what to set instead."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from stratagem.errors import ConfigurationError
from stratagem_deepspeed import _options as o

if TYPE_CHECKING:
    from stratagem_deepspeed._config import DeepSpeedConfig

#: Options that tune one swap, and the setting that creates it.
PARAMS_NVME_OPTIONS = ("params_buffer_count", "params_buffer_size", "max_in_cpu")
OPTIMIZER_NVME_OPTIONS = ("optimizer_buffer_count",)
AIO_OPTIONS = ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")
#: Options a whole ``config`` may come with: the registry's names preset the first three, and the last three are
#: not DeepSpeed config keys of their own (logging; the throughput batch size fills a key the config may lack).
ALLOWED_WITH_CONFIG = {
    "stage",
    "offload_optimizer",
    "offload_parameters",
    "logging_level",
    "logging_batch_size_per_gpu",
}
#: Where each named option lives in a DeepSpeed config, for the message that refuses it next to ``config``.
CONFIG_KEYS = {
    "allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "contiguous_gradients": "zero_optimization.contiguous_gradients",
    "overlap_comm": "zero_optimization.overlap_comm",
    "sub_group_size": "zero_optimization.sub_group_size",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_params_device": "zero_optimization.offload_param.device",
    "nvme_path": "zero_optimization.offload_*.nvme_path",
    "params_buffer_count": "zero_optimization.offload_param.buffer_count",
    "params_buffer_size": "zero_optimization.offload_param.buffer_size",
    "max_in_cpu": "zero_optimization.offload_param.max_in_cpu",
    "optimizer_buffer_count": "zero_optimization.offload_optimizer.buffer_count",
    "pin_memory": "zero_optimization.offload_*.pin_memory",
    "block_size": "aio.block_size",
    "queue_depth": "aio.queue_depth",
    "single_submit": "aio.single_submit",
    "overlap_events": "aio.overlap_events",
    "thread_count": "aio.intra_op_parallelism",
    "partition_activations": "activation_checkpointing.partition_activations",
    "cpu_checkpointing": "activation_checkpointing.cpu_checkpointing",
    "contiguous_memory_optimization": "activation_checkpointing.contiguous_memory_optimization",
    "number_checkpoints": "activation_checkpointing.number_checkpoints",
    "synchronize_checkpoint_boundary": "activation_checkpointing.synchronize_checkpoint_boundary",
    "loss_scale": "fp16.loss_scale",
    "initial_scale_power": "fp16.initial_scale_power",
    "loss_scale_window": "fp16.loss_scale_window",
    "hysteresis": "fp16.hysteresis",
    "min_loss_scale": "fp16.min_loss_scale",
}


#: Options of the seeds that stratagem spells elsewhere, with where.
ELSEWHERE = {
    "save_full_weights": (
        "stratagem chooses the checkpoint format per save: Trainer(checkpoint_format='full') writes one file of "
        "whole weights, 'sharded' (the default here) DeepSpeed's directory; engine.save(path, state, "
        "format=...) likewise"
    ),
}


def check_names(options: dict[str, Any], accepted: list[str]) -> None:
    for name in options:
        if name in accepted:
            continue
        if name in ELSEWHERE:
            raise ConfigurationError(
                f"DeepSpeedStrategy({name}=...) is not an option here: {ELSEWHERE[name]}."
            )
        close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"DeepSpeedStrategy got an unknown option {name!r}.{hint} Accepted: {', '.join(sorted(accepted))}."
        )


def check_user_config(config: DeepSpeedConfig) -> None:
    user = config.config or {}
    given = sorted(set(config.non_default()) - ALLOWED_WITH_CONFIG)
    if given:
        where = ", ".join(f"{name} -> {CONFIG_KEYS.get(name, name)}" for name in given)
        raise ConfigurationError(
            f"DeepSpeed config= is a whole DeepSpeed config, so the named options are not applied next to it; "
            f"got {', '.join(given)} besides. Put them in the config instead ({where}), or drop config=."
        )
    gas = user.get("gradient_accumulation_steps", 1)
    if gas not in (1, "auto"):
        raise ConfigurationError(
            f"DeepSpeed config gradient_accumulation_steps={gas!r}: stratagem's loop accumulates (the "
            "Trainer's accumulate_grad_batches, or several engine.backward calls per optimizer step). "
            "Remove the key or set it to 1."
        )
    zero = user.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigurationError(f"DeepSpeed config zero_optimization={zero!r}: expected an object.")
    o.stage(zero.get("stage", 0))
    micro = user.get("train_micro_batch_size_per_gpu")
    if (
        micro is not None
        and config.logging_batch_size_per_gpu != 1
        and micro != config.logging_batch_size_per_gpu
    ):
        raise ConfigurationError(
            f"DeepSpeed logging_batch_size_per_gpu={config.logging_batch_size_per_gpu} but the config says "
            f"train_micro_batch_size_per_gpu={micro}: they are the same setting. Keep one."
        )
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if isinstance(section, dict) and section.get("device") == "nvme" and not section.get("nvme_path"):
            raise ConfigurationError(
                f"DeepSpeed config zero_optimization.{key}.device='nvme' needs an nvme_path: the directory "
                "DeepSpeed writes its swap files in."
            )
    check_nvme_paths(config)
    activation = user.get("activation_checkpointing") or {}
    if activation.get("contiguous_memory_optimization") and not (
        activation.get("partition_activations") and activation.get("number_checkpoints")
    ):
        raise ConfigurationError(
            "DeepSpeed config activation_checkpointing.contiguous_memory_optimization=true needs "
            "partition_activations=true and number_checkpoints (the checkpoint calls per forward)."
        )


def nvme_paths(config: DeepSpeedConfig) -> list[str]:
    """The directories DeepSpeed will write swap files in, for the named options or a whole config."""
    if config.config is None:
        return [config.nvme_path] if uses_nvme(config) and config.nvme_path else []
    zero = config.config.get("zero_optimization") or {}
    found = []
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if isinstance(section, dict) and section.get("device") == "nvme" and section.get("nvme_path"):
            found.append(str(section["nvme_path"]))
    return found


def check_nvme_paths(config: DeepSpeedConfig) -> None:
    """Where the strategy is built and again in each worker: the directory must be there, and writable."""
    for where in nvme_paths(config):
        o.check_writable_directory(where)


def check_named_options(config: DeepSpeedConfig) -> None:
    _check_offload(config)
    _check_nvme(config)
    _check_activation_checkpointing(config)
    if config.sub_group_size != 1_000_000_000 and config.stage != 3:
        raise ConfigurationError(
            f"DeepSpeed sub_group_size={config.sub_group_size} with stage={config.stage}: only ZeRO stage 3 steps "
            "the optimizer in sub-groups. Use stage=3, or remove the option."
        )


def _check_offload(config: DeepSpeedConfig) -> None:
    if config.offload_parameters and config.stage != 3:
        raise ConfigurationError(
            f"offload_parameters=True with stage={config.stage}: only ZeRO stage 3 partitions (and so can "
            "offload) the parameters. Use stage=3, or offload_optimizer=True alone."
        )
    if config.offload_optimizer and config.stage == 0:
        raise ConfigurationError(
            "offload_optimizer=True with stage=0: optimizer offload needs ZeRO (stage 1, 2 or 3)."
        )
    if config.offload_params_device == "nvme" and not config.offload_parameters:
        raise ConfigurationError(
            "DeepSpeed offload_params_device='nvme' without offload_parameters=True: nothing would be "
            "offloaded. Set offload_parameters=True (stage 3)."
        )
    if config.offload_optimizer_device == "nvme" and not config.offload_optimizer:
        raise ConfigurationError(
            "DeepSpeed offload_optimizer_device='nvme' without offload_optimizer=True: nothing would be "
            "offloaded. Set offload_optimizer=True."
        )
    if config.pin_memory is not None and not (config.offload_optimizer or config.offload_parameters):
        raise ConfigurationError(
            f"DeepSpeed pin_memory={config.pin_memory}: it applies to offloaded state, and nothing is "
            "offloaded. Set offload_optimizer=True or offload_parameters=True, or remove the option."
        )
    remote = config.remote_device
    if remote is None:
        return
    if config.stage != 3:
        raise ConfigurationError(
            f"DeepSpeed remote_device={remote!r} with stage={config.stage}: only stage 3 builds the model "
            "partitioned (zero.Init). Use stage=3, or remove the option."
        )
    if config.offload_parameters and remote != config.offload_params_device:
        raise ConfigurationError(
            f"DeepSpeed remote_device={remote!r} but offload_params_device={config.offload_params_device!r}: "
            "with offloaded parameters DeepSpeed keeps them on the offload device from the start. Give the "
            "same device to both, or leave remote_device=None."
        )
    if remote == "nvme" and not config.offload_parameters:
        raise ConfigurationError(
            "DeepSpeed remote_device='nvme' needs offload_parameters=True with offload_params_device='nvme' "
            "(and nvme_path): the NVMe swap that zero.Init writes through is the parameters' offload."
        )


def _check_nvme(config: DeepSpeedConfig) -> None:
    given = config.non_default()
    params_nvme = config.offload_parameters and config.offload_params_device == "nvme"
    optimizer_nvme = config.offload_optimizer and config.offload_optimizer_device == "nvme"
    if params_nvme or optimizer_nvme:
        if config.nvme_path is None:
            which = "offload_params_device" if params_nvme else "offload_optimizer_device"
            raise ConfigurationError(
                f"DeepSpeed {which}='nvme' needs nvme_path: an existing directory on a local NVMe drive (any "
                "writable local directory works, more slowly), where DeepSpeed writes its swap files."
            )
        check_nvme_paths(config)
    elif config.nvme_path is not None:
        raise ConfigurationError(
            f"DeepSpeed nvme_path={config.nvme_path!r}: no offload device is 'nvme', so nothing would be written "
            "there. Set offload_params_device='nvme' (with offload_parameters=True) or "
            "offload_optimizer_device='nvme' (with offload_optimizer=True), or remove nvme_path."
        )
    _needs(given, PARAMS_NVME_OPTIONS, params_nvme, "offload_parameters=True, offload_params_device='nvme'")
    _needs(
        given,
        OPTIMIZER_NVME_OPTIONS,
        optimizer_nvme,
        "offload_optimizer=True, offload_optimizer_device='nvme'",
    )
    _needs(given, AIO_OPTIONS, params_nvme or optimizer_nvme, "an offload device 'nvme'")


def _needs(given: dict[str, Any], names: tuple[str, ...], active: bool, what: str) -> None:
    tuned = [name for name in names if name in given]
    if tuned and not active:
        raise ConfigurationError(
            f"DeepSpeed {', '.join(f'{n}={given[n]!r}' for n in tuned)}: tunes the NVMe swap, which needs "
            f"{what} (and nvme_path). Set that, or remove the option(s)."
        )


def _check_activation_checkpointing(config: DeepSpeedConfig) -> None:
    partition = (
        config.cpu_checkpointing if config.partition_activations is None else config.partition_activations
    )
    if config.contiguous_memory_optimization:
        if not partition:
            raise ConfigurationError(
                "DeepSpeed contiguous_memory_optimization=True needs partition_activations=True: DeepSpeed "
                "copies the partitioned inputs into the contiguous buffers."
            )
        if config.number_checkpoints is None:
            raise ConfigurationError(
                "DeepSpeed contiguous_memory_optimization=True needs number_checkpoints: how many "
                "deepspeed.checkpointing.checkpoint calls one forward makes (it sizes the buffers)."
            )
    elif config.number_checkpoints is not None:
        raise ConfigurationError(
            f"DeepSpeed number_checkpoints={config.number_checkpoints}: it sizes the buffers of "
            "contiguous_memory_optimization, which is off. Set contiguous_memory_optimization=True "
            "(with partition_activations=True), or remove the option."
        )


def uses_nvme(cfg: DeepSpeedConfig) -> bool:
    return (cfg.offload_parameters and cfg.offload_params_device == "nvme") or (
        cfg.offload_optimizer and cfg.offload_optimizer_device == "nvme"
    )


def check_precision_options(config: DeepSpeedConfig, precision: str) -> None:
    """fp16 loss scaling options mean nothing under another precision: refuse them rather than drop them."""
    scaling = {"loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}
    given = sorted(set(config.non_default()) & scaling)
    if given and precision != "16-mixed":
        raise ConfigurationError(
            f"DeepSpeed {', '.join(given)}: fp16 loss scaling applies to precision='16-mixed' only; this run's "
            f"precision is {precision!r}, which scales no loss. Remove the option(s), or train in '16-mixed'."
        )
