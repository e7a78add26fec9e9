"""``stratagem.Module``: a ``torch.nn.Module`` with the hooks the Trainer calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from stratagem.trainer import Trainer


class Module(torch.nn.Module):
    """Write the model and its training step; the Trainer does the rest.

    Override :meth:`training_step` (required) and :meth:`configure_optimizers` (required for ``fit``);
    :meth:`configure_model` builds large layers under the strategy's init and sharding contexts;
    :meth:`validation_step` runs on ``val_loader``. Call :meth:`log` to record metrics.
    """

    def configure_model(self) -> None:
        """Build layers here to have them created on the meta device and sharded as they are built."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Return the loss of one batch (or a dict with key ``"loss"``)."""
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        """Compute validation metrics of one batch; log them with :meth:`log`."""
        return None

    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of optimizers, or ``{"optimizer": opt, "lr_scheduler": sched}``."""
        return None

    @property
    def trainer(self) -> Trainer | None:
        return self.__dict__.get("_stratagem_trainer")

    def log(self, name: str, value: Any, *, prog_bar: bool = True, reduce: str = "mean") -> None:
        """Record a metric for this step: reduced across ranks, shown on the bar, written to the CSV log."""
        trainer = self.trainer
        if trainer is None:
            return
        trainer._log_metric(name, value, prog_bar=prog_bar, reduce=reduce)

    @classmethod
    def overrides(cls, name: str) -> bool:
        return getattr(cls, name) is not getattr(Module, name)
