"""What ``Trainer.fit`` and ``validate`` check before anything launches: the model, the loaders, the checkpoint
to resume from, what ``configure_optimizers`` returns, and that the process can re-run itself in workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _atomic, _store
from stratagem.errors import CheckpointError, ConfigurationError
from stratagem.launchers import _rerun
from stratagem.trainer._configured_optimizers import parse_optimizers
from stratagem.trainer._planned_module import fit_workload
from stratagem.trainer.module import Module, defines_loss


def provides_optimizer(strategy: Any) -> bool:
    """Whether the strategy's own configuration defines the optimizer (see ``Strategy.provides_optimizer``)."""
    return bool(getattr(strategy, "provides_optimizer", False))


def check_fit(
    engine: Any,
    model: Any,
    train_dataloaders: Any,
    val_dataloaders: Any,
    ckpt_path: Any,
    *,
    strategy_made: bool,
) -> None:
    """What ``fit`` is given; ``strategy_made``: the model's steps are checked against the strategy too.
    ``strategy="auto"`` on several processes is chosen here, by a plan of the model and the loader's first batch
    (docs/planning.md), once both are known good and before the steps are checked against it."""

    # Asked only when configure_optimizers gives nothing: it creates the strategy in a launching process.
    def strategy_optimizer() -> bool:
        return provides_optimizer(engine.strategy)

    check_model(model, for_fit=True, strategy_optimizer=strategy_optimizer)
    check_loader(train_dataloaders, "train_dataloaders")
    if engine.plans_auto:
        engine.choose_strategy(fit_workload(model, train_dataloaders))
    check_step(model, engine.strategy if strategy_made else None)
    if val_dataloaders is not None:
        check_loader(val_dataloaders, "val_dataloaders")
    check_ckpt_path(ckpt_path)
    if engine.needs_launch:
        check_optimizers_before_launch(model, strategy_optimizer)


def check_model(model: Any, *, for_fit: bool, strategy_optimizer: Callable[[], bool] = lambda: False) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError(
            f"The model is a {type(model).__name__}; give a stratagem.Module (a torch.nn.Module with "
            "training_step and configure_optimizers)."
        )
    if not for_fit:
        return
    step = getattr(type(model), "training_step", None)
    if (step is None or step is Module.training_step) and not defines_loss(model):
        raise ConfigurationError(
            f"{type(model).__name__} has no training_step(batch, batch_idx). Define it to return the loss, or "
            "define compute_loss(outputs, targets) (and split_batch(batch) when a batch is not an "
            "(inputs, targets) pair)."
        )
    configure = getattr(type(model), "configure_optimizers", None)
    if (configure is None or configure is Module.configure_optimizers) and not strategy_optimizer():
        raise ConfigurationError(
            f"{type(model).__name__} has no configure_optimizers(). Define it to return an optimizer, a "
            "list of optimizers, or {'optimizer': opt, 'lr_scheduler': scheduler}."
        )


def check_step(model: Any, strategy: Any) -> None:
    """A strategy that runs the step itself never calls ``training_step``: it needs the module's loss."""
    if strategy is None or not getattr(strategy, "owns_step", False) or defines_loss(model):
        return
    raise ConfigurationError(
        f"strategy {strategy.name!r} runs forward and backward of each batch itself (over micro-batches and "
        f"stages) and cannot call training_step. Give {type(model).__name__} compute_loss(outputs, targets) "
        "returning the mean loss (or a loss_fn attribute), and split_batch(batch) -> (inputs, targets) when a "
        "batch is not an (inputs, targets) pair; the default training_step is then built from them, so the module "
        "trains the same under every strategy."
    )


def check_loader(loader: Any, name: str) -> None:
    if loader is None or not hasattr(loader, "__iter__"):
        raise ConfigurationError(f"fit({name}={loader!r}): give an iterable of batches (a DataLoader).")


def check_ckpt_path(ckpt_path: Any) -> None:
    if ckpt_path is None or ckpt_path == "last":
        return
    target = _store.location(ckpt_path)
    if isinstance(target, Path) and not target.exists() and not _atomic.old_sibling(target).exists():
        raise CheckpointError(
            target,
            'does not exist. Pass an existing checkpoint, "last" (the newest under '
            "default_root_dir, if any), or None to start fresh.",
        )


def check_optimizers_before_launch(model: Module, strategy_optimizer: Callable[[], bool]) -> None:
    """Catch a configure_optimizers that returns nothing before starting workers: build the model on the
    meta device here (this process never trains) and look at what it returns."""
    try:
        with torch.device("meta"):
            model.configure_model()
        result = model.configure_optimizers()
    except Exception:
        return  # something only the workers can do; they check it for real
    if result is None and strategy_optimizer():
        return
    parse_optimizers(result, type(model).__name__)


def configured_optimizers(model: Module, strategy: Any) -> tuple[list[Any], list[Any]]:
    """``configure_optimizers``' optimizers and schedulers; none at all when it returns ``None`` and the
    strategy's own configuration provides the optimizer."""
    result = model.configure_optimizers()
    if result is None and provides_optimizer(strategy):
        return [], []
    return parse_optimizers(result, type(model).__name__)


def check_relaunchable(devices: int) -> None:
    """The Trainer's workers re-run the script: refuse where there is none to re-run."""
    started = _rerun.how_started()
    if started == "interactive":
        raise ConfigurationError(
            f"devices={devices} from an interactive session: the workers re-run the script, "
            "and there is none. Run it as `python script.py`, or start it with torchrun or "
            "`stratagem run --devices N script.py`; for a function, use Engine.launch(fn)."
        )
    if started == "pytest":
        raise ConfigurationError(
            f"devices={devices} inside pytest would re-run pytest in every worker. Run the "
            "training in a script (python script.py) from the test, or use Engine.launch(fn)."
        )
