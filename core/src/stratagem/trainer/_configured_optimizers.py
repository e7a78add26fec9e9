"""What ``configure_optimizers`` may return, turned into optimizers and schedulers (or a clear error)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from stratagem.errors import ConfigurationError


@attrs.define
class Scheduler:
    """A learning-rate scheduler and when the loop steps it."""

    scheduler: Any
    interval: str = "step"
    frequency: int = 1


def parse_optimizers(result: Any, model_name: str) -> tuple[list[Any], list[Scheduler]]:
    """``configure_optimizers``' result as (optimizers, schedulers), or a clear error."""
    hint = (
        f"{model_name}.configure_optimizers() must return an optimizer, a list of optimizers, or "
        "{'optimizer': opt, 'lr_scheduler': scheduler}"
    )
    schedulers: list[Scheduler] = []
    if isinstance(result, dict):
        if "optimizer" not in result:
            raise ConfigurationError(f"{hint}; the dict has no 'optimizer' key.")
        optimizers = result["optimizer"]
        optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        sched = result.get("lr_scheduler")
        if sched is not None:
            schedulers.append(parse_scheduler(sched, hint))
    elif isinstance(result, (list, tuple)):
        optimizers = list(result)
    else:
        optimizers = [result]
    if not optimizers or any(not is_optimizer(o) for o in optimizers):
        got = (
            "nothing"
            if result is None or (isinstance(result, (list, tuple)) and not result)
            else repr(result)
        )
        raise ConfigurationError(f"{hint}; it returned {got}.")
    return optimizers, schedulers


def parse_scheduler(sched: Any, hint: str) -> Scheduler:
    if isinstance(sched, dict):
        if "scheduler" not in sched:
            raise ConfigurationError(f"{hint}; the lr_scheduler dict has no 'scheduler' key.")
        interval = sched.get("interval", "step")
        if interval not in ("step", "epoch"):
            raise ConfigurationError(f"lr_scheduler interval={interval!r}: use 'step' or 'epoch'.")
        frequency = sched.get("frequency", 1)
        if not isinstance(frequency, int) or frequency < 1:
            raise ConfigurationError(f"lr_scheduler frequency={frequency!r}: give a positive integer.")
        return Scheduler(sched["scheduler"], interval, frequency)
    if not hasattr(sched, "step"):
        raise ConfigurationError(f"{hint}; lr_scheduler {sched!r} has no step().")
    return Scheduler(sched)


def is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or (hasattr(obj, "param_groups") and hasattr(obj, "step"))
