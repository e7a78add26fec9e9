"""The Trainer's options: checked when the Trainer is made, before anything launches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from stratagem.errors import ConfigurationError


def _optional_positive(kind: type) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
            raise ConfigurationError(
                f"Trainer({attribute.name}={value!r}): give a positive {kind.__name__} or None."
            )

    return check


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"Trainer({attribute.name}={value!r}): give a positive integer.")


def _non_negative_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"Trainer({attribute.name}={value!r}): give 0 or a positive integer.")


def _flag(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigurationError(f"Trainer({attribute.name}={value!r}): give True or False.")


def _optional_float(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _clip_value(value: Any) -> float | None:
    return None if value is None else float(value)


def _root_dir(value: Any) -> Path | str:
    """A local directory as a Path; an object-store URL kept as it is (its scheme checked)."""
    from stratagem.checkpoint._store import location

    return location(value)


@attrs.frozen(kw_only=True)
class TrainerOptions:
    """The loop's options, checked when the Trainer is made (before anything launches)."""

    max_steps: int | None = attrs.field(default=None, validator=_optional_positive(int))
    max_epochs: int | None = attrs.field(default=None, validator=_optional_positive(int))
    accumulate_grad_batches: int = attrs.field(default=1, validator=_positive_int)
    gradient_clip_val: float | None = attrs.field(
        default=None, converter=_clip_value, validator=_optional_positive(float)
    )
    val_check_interval: int | None = attrs.field(default=None, validator=_optional_positive(int))
    limit_val_batches: int | None = attrs.field(default=None, validator=_optional_positive(int))
    checkpoint_every_n_steps: int | None = attrs.field(default=None, validator=_optional_positive(int))
    keep_last_k: int | None = attrs.field(default=None, validator=_optional_positive(int))
    checkpoint_format: str | None = attrs.field(default=None)
    default_root_dir: Path | str = attrs.field(default=Path("runs"), converter=_root_dir)
    seed: int | None = attrs.field(default=None)
    log_every_n_steps: int = attrs.field(default=10, validator=_positive_int)
    enable_progress_bar: bool = True
    use_distributed_sampler: bool = True
    max_restarts: int = attrs.field(default=0, validator=_non_negative_int)
    checkpoint_every_n_minutes: float | None = attrs.field(
        default=None, converter=_optional_float, validator=_optional_positive(float)
    )
    restart_from_scratch: bool = False
    async_checkpoint: bool = False
    keep_global_batch: bool = attrs.field(default=True, validator=_flag)

    def __attrs_post_init__(self) -> None:
        if self.max_restarts:
            self.check_restarts_can_resume(f"Trainer(max_restarts={self.max_restarts})")

    def check_restarts_can_resume(self, allowed_by: str) -> None:
        """Refuse restarts that could only start over: a restart resumes from the newest checkpoint of the
        run, and with no cadence none is written. ``allowed_by`` says who allows the restarts."""
        periodic = self.checkpoint_every_n_steps is not None or self.checkpoint_every_n_minutes is not None
        if not periodic and not self.restart_from_scratch:
            raise ConfigurationError(
                f"{allowed_by} without checkpoint_every_n_steps or checkpoint_every_n_minutes: a restarted run "
                "would find no checkpoint and start again from step 0. Set a checkpoint cadence, or pass "
                "restart_from_scratch=True if that is what you want."
            )

    @checkpoint_format.validator
    def _check_format(self, attribute: attrs.Attribute, value: Any) -> None:
        if value not in (None, "full", "sharded"):
            raise ConfigurationError(f"Trainer(checkpoint_format={value!r}): use 'full', 'sharded' or None.")

    @seed.validator
    def _check_seed(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigurationError(f"Trainer(seed={value!r}): give an integer or None.")
