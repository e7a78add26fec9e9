"""Whose optimizer DeepSpeed drives: the one the user built (``configure_optimizers``, ``engine.setup``) or the
one the DeepSpeed config's ``optimizer`` section names. Exactly one; both or neither is refused with what to
remove or add. A config ``scheduler`` section is DeepSpeed's to step (``engine.step``), so a torch scheduler
on the user's optimizer next to it would change the learning rate twice per step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    from stratagem_deepspeed._config import DeepSpeedConfig


def check_choice(config: DeepSpeedConfig, optimizers: list[Any]) -> bool:
    """True when DeepSpeed builds the optimizer from its config; raise when that choice is ambiguous."""
    own = config.config_optimizer
    if own is not None and optimizers:
        raise ConfigurationError(
            f"Two optimizers: the DeepSpeed config has an 'optimizer' section ({own}) and "
            f"configure_optimizers() returns one too ({type(optimizers[0]).__name__}; or one was passed to "
            "setup()). "
            "DeepSpeed drives one. To train with the config's, remove configure_optimizers() (or return None "
            "from it); to train with yours, remove the 'optimizer' section from the DeepSpeed config."
        )
    if own is None and not optimizers:
        raise ConfigurationError(
            "No optimizer: configure_optimizers() returned none (or setup_optimizers() got none) and the "
            "DeepSpeed config has no 'optimizer' section. Return an optimizer from configure_optimizers(), "
            "or give DeepSpeedStrategy(config=...) an 'optimizer' section."
        )
    if len(optimizers) > 1:
        raise ConfigurationError(
            f"DeepSpeed drives exactly one optimizer per model; got {len(optimizers)}. Put the parameters "
            "in one optimizer (several parameter groups are fine)."
        )
    scheduler = config.config_scheduler
    if scheduler is not None and optimizers and any("initial_lr" in g for g in optimizers[0].param_groups):
        raise ConfigurationError(
            f"Two learning-rate schedulers: the DeepSpeed config has a 'scheduler' section ({scheduler}), "
            "which DeepSpeed steps with each optimizer step, and your optimizer has a torch scheduler already "
            "(its parameter groups carry 'initial_lr'; configure_optimizers() returned an lr_scheduler). "
            "Remove one: the config's 'scheduler' section, or the lr_scheduler."
        )
    return own is not None


def trainable(module: Any) -> list[Any]:
    """The parameters DeepSpeed's own optimizer steps: the module's trainable ones, in module order."""
    return [p for p in module.parameters() if p.requires_grad]
