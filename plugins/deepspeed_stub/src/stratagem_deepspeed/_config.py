"""The options of the DeepSpeed strategies, and the DeepSpeed config they turn into.

Two ways to configure, as in the seeds: the named options below (each becomes a key of DeepSpeed's
``zero_optimization`` section), or ``config``, a whole DeepSpeed config (a dict or a JSON file), in which case
the named options' defaults are not applied. Either way the strategy adds what stratagem owns: the precision
section from ``precision=``, one micro-batch per ``engine.step`` (stratagem's loop accumulates), and no
periodic DeepSpeed logging.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import attrs

from stratagem.errors import ConfigurationError

#: The environment variable naming a DeepSpeed JSON config when the strategy is given none.
CONFIG_ENV = "STRATAGEM_DEEPSPEED_CONFIG"

#: The stages DeepSpeed's ZeRO offers; 0 is plain data parallelism through DeepSpeed's engine.
STAGES = (0, 1, 2, 3)
#: Keys of a user's config that stratagem drives itself; a config that sets them otherwise is refused.
_OWNED_PRECISION_KEYS = ("fp16", "bf16", "amp", "torch_autocast")


def _stage(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in STAGES:
        raise ConfigurationError(f"DeepSpeed stage={value!r}: use one of {', '.join(map(str, STAGES))}.")
    return value


def _bucket(value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(
            f"bucket size {value!r}: give a positive number of elements, e.g. 200_000_000."
        )
    return value


def _flag(name: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            raise ConfigurationError(f"DeepSpeed {name}={value!r}: use True or False.")

    return check


def load_config(value: Any) -> dict[str, Any] | None:
    """A DeepSpeed config as a dict: ``None``, a dict (copied), or the path of a JSON file."""
    if value is None:
        return None
    if isinstance(value, dict):
        return json.loads(json.dumps(value)) if _jsonable(value) else dict(value)
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigurationError(
                f"DeepSpeed config={os.fspath(value)!r}: no such file. Give a dict or the path of a JSON file."
            )
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigurationError(f"DeepSpeed config {path}: not readable as JSON: {error}") from error
        if not isinstance(loaded, dict):
            raise ConfigurationError(
                f"DeepSpeed config {path}: the top level is a {type(loaded).__name__}, not an object."
            )
        return loaded
    raise ConfigurationError(
        f"DeepSpeed config={value!r}: give a dict or the path of a JSON file (a {type(value).__name__} is neither)."
    )


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _logging_level(value: Any) -> int:
    if isinstance(value, str):
        level = logging.getLevelName(value.upper())
        if isinstance(level, int):
            return level
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigurationError(
        f"DeepSpeed logging_level={value!r}: use a logging level such as logging.WARNING or 'INFO'."
    )


@attrs.frozen(kw_only=True)
class DeepSpeedConfig:
    """The DeepSpeed strategies' options (names as in the seeds).

    :param stage: the ZeRO stage: 1 partitions the optimizer state, 2 also the gradients, 3 also the
        parameters (0: DeepSpeed's engine without partitioning).
    :param offload_optimizer: keep the optimizer state in CPU memory and step there (stages 1-3).
    :param offload_parameters: keep the parameters in CPU memory between uses (stage 3 only).
    :param allgather_bucket_size: elements gathered at a time after the step (stages 1-2).
    :param reduce_bucket_size: elements reduced at a time during backward.
    :param contiguous_gradients: copy gradients into one buffer as they are reduced (less fragmentation).
    :param overlap_comm: reduce gradients while backward still runs.
    :param cpu_checkpointing: with DeepSpeed activation checkpointing, keep the checkpoints in CPU memory.
    :param config: a whole DeepSpeed config (a dict or a JSON file's path); when given, the options above are
        not applied: the config says everything.
    :param logging_level: the level of DeepSpeed's own logger.
    """

    stage: int = attrs.field(default=2, converter=_stage)
    offload_optimizer: bool = attrs.field(default=False, validator=_flag("offload_optimizer"))
    offload_parameters: bool = attrs.field(default=False, validator=_flag("offload_parameters"))
    allgather_bucket_size: int = attrs.field(default=200_000_000, converter=_bucket)
    reduce_bucket_size: int = attrs.field(default=200_000_000, converter=_bucket)
    contiguous_gradients: bool = attrs.field(default=True, validator=_flag("contiguous_gradients"))
    overlap_comm: bool = attrs.field(default=True, validator=_flag("overlap_comm"))
    cpu_checkpointing: bool = attrs.field(default=False, validator=_flag("cpu_checkpointing"))
    config: dict[str, Any] | None = attrs.field(default=None, converter=load_config, repr=False)
    logging_level: int = attrs.field(default=logging.WARNING, converter=_logging_level)

    def __attrs_post_init__(self) -> None:
        if self.config is not None:
            self._check_user_config(self.config)
            return
        if self.offload_parameters and self.stage != 3:
            raise ConfigurationError(
                f"offload_parameters=True with stage={self.stage}: only ZeRO stage 3 partitions (and so can "
                "offload) the parameters. Use stage=3, or offload_optimizer=True alone."
            )
        if self.offload_optimizer and self.stage == 0:
            raise ConfigurationError(
                "offload_optimizer=True with stage=0: optimizer offload needs ZeRO (stage 1, 2 or 3)."
            )

    @staticmethod
    def _check_user_config(config: dict[str, Any]) -> None:
        gas = config.get("gradient_accumulation_steps", 1)
        if gas not in (1, "auto"):
            raise ConfigurationError(
                f"DeepSpeed config gradient_accumulation_steps={gas!r}: stratagem's loop accumulates (the "
                "Trainer's accumulate_grad_batches, or several engine.backward calls per optimizer step). "
                "Remove the key or set it to 1."
            )
        zero = config.get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ConfigurationError(f"DeepSpeed config zero_optimization={zero!r}: expected an object.")
        _stage(zero.get("stage", 0))

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

    def deepspeed_config(
        self, precision: str, accelerator: str = "cpu", model_numel: int | None = None
    ) -> dict[str, Any]:
        """The config passed to ``deepspeed.initialize`` for this precision and accelerator.

        :param model_numel: the model's parameter count; the named options' buckets are capped at it (a bucket
            larger than the model holds nothing more, but DeepSpeed allocates it whole).
        """
        if self.config is not None:
            config = json.loads(json.dumps(self.config)) if _jsonable(self.config) else dict(self.config)
            for key in _OWNED_PRECISION_KEYS:
                section = config.get(key)
                if isinstance(section, dict) and section.get("enabled") and key != _precision_key(precision):
                    raise ConfigurationError(
                        f"DeepSpeed config enables {key!r}, but the run's precision is {precision!r}. Set the "
                        f"precision instead (precision='bf16-mixed' enables DeepSpeed's bf16, '16-mixed' its "
                        "fp16) and remove the section."
                    )
        else:
            config = {
                "zero_optimization": self._zero_section(pin_memory=accelerator == "cuda", cap=model_numel)
            }
            if self.cpu_checkpointing:
                config["activation_checkpointing"] = {
                    "partition_activations": True,
                    "cpu_checkpointing": True,
                }
        config.setdefault("train_micro_batch_size_per_gpu", 1)
        config["gradient_accumulation_steps"] = 1
        config.setdefault("steps_per_print", 2**62)
        config.setdefault("wall_clock_breakdown", False)
        # The user's optimizer is used as given; DeepSpeed would otherwise refuse optimizers it has not
        # tested with ZeRO, and torch.optim optimizers with offload (it prefers its own compiled CPU Adam).
        # DeepSpeed clips the gradient norm at 1.0 when the config names no `gradient_clipping` (its
        # GRADIENT_CLIPPING_DEFAULT): a silent change to the user's optimization that no other strategy makes.
        # Clipping happens when asked (clip_gradients, the Trainer's gradient_clip_val), or by the user's config.
        config.setdefault("gradient_clipping", 0.0)
        config.setdefault("zero_allow_untested_optimizer", True)
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        key = _precision_key(precision)
        if key == "bf16":
            config["bf16"] = {**config.get("bf16", {}), "enabled": True}
        elif key == "fp16":
            config["fp16"] = {"initial_scale_power": 16, **config.get("fp16", {}), "enabled": True}
        return config

    def _zero_section(self, pin_memory: bool, cap: int | None) -> dict[str, Any]:
        def capped(size: int) -> int:
            return size if cap is None else max(1, min(size, cap))

        section: dict[str, Any] = {
            "stage": self.stage,
            "contiguous_gradients": self.contiguous_gradients,
            "overlap_comm": self.overlap_comm,
            "reduce_bucket_size": capped(self.reduce_bucket_size),
        }
        if self.stage in (1, 2):
            section["allgather_bucket_size"] = capped(self.allgather_bucket_size)
        if self.stage == 3:
            section["stage3_prefetch_bucket_size"] = capped(50_000_000)
        if self.offload_optimizer:
            section["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
        if self.offload_parameters:
            section["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
        return section


def _precision_key(precision: str) -> str | None:
    return {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}.get(precision)
