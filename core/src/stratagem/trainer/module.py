"""``stratagem.Module``: a ``torch.nn.Module`` with the hooks the Trainer calls."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from stratagem.errors import ConfigurationError


class Attached(Protocol):
    """What a Module is attached to while it trains (the Trainer): where its metrics go.

    The Module layer sits below the Trainer and never imports it; the Trainer attaches itself.
    """

    def log(self, name: str, value: Any, *, prog_bar: bool = ..., reduce: str = ...) -> None: ...


class Module(torch.nn.Module):
    """Write the model and its training step; the Trainer does the rest.

    Override :meth:`training_step` (or :meth:`compute_loss`, see below) and :meth:`configure_optimizers`
    (required for ``fit``);
    :meth:`configure_model` builds large layers under the strategy's init and sharding contexts;
    :meth:`validation_step` runs on ``val_loader``. Call :meth:`log` to record metrics.
    :meth:`on_save_checkpoint` / :meth:`on_load_checkpoint` carry extra state of your own through checkpoints.

    The pair :meth:`split_batch` / :meth:`compute_loss` (or a ``loss_fn`` attribute) says how a batch splits
    into the model's inputs and targets and how the loss is computed from the outputs. A module written with
    it needs no ``training_step`` (the default one is built from the pair) and trains under every strategy,
    including those that run the step themselves (pipelines), which never call ``training_step``.
    """

    def configure_model(self) -> None:
        """Build layers here to have them created on the meta device and sharded as they are built.

        Called once per process before the model is wrapped (a second ``fit`` does not call it again).
        """

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Return the loss of one batch (or a dict with key ``"loss"``).

        The default, for a module that defines its loss (:meth:`compute_loss` or ``loss_fn``):
        ``compute_loss(self(*inputs), targets)`` with ``(inputs, targets) = split_batch(batch)``.
        """
        if not defines_loss(self):
            raise NotImplementedError(
                f"{type(self).__name__} defines neither training_step nor compute_loss (or loss_fn)."
            )
        inputs, targets = self.split_batch(batch)
        return self.compute_loss(self(*inputs), targets)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        """Compute validation metrics of one batch; log them with :meth:`log`.

        The default, for a module that defines its loss: log ``val_loss`` (what a strategy that runs the step
        itself logs), when the batch has targets.
        """
        if not defines_loss(self):
            return None
        inputs, targets = self.split_batch(batch)
        if targets is None:
            return None
        loss = self.compute_loss(self(*inputs), targets)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of optimizers, or ``{"optimizer": opt, "lr_scheduler": sched}``.

        ``lr_scheduler`` may also be ``{"scheduler": sched, "interval": "step" | "epoch", "frequency": n}``
        (default: stepped after every optimizer step).
        """
        return None

    def on_save_checkpoint(self, extras: dict[str, Any]) -> None:
        """Add state of your own to ``extras`` (tensors and builtins only); it comes back in
        :meth:`on_load_checkpoint` when training resumes."""

    def on_load_checkpoint(self, extras: dict[str, Any]) -> None:
        """Restore what :meth:`on_save_checkpoint` stored."""

    @property
    def trainer(self) -> Any:
        """The Trainer fitting this module (its ``engine``, ``global_step``, ...), or ``None`` outside ``fit``."""
        return self.__dict__.get("_stratagem_trainer")

    def log(self, name: str, value: Any, *, prog_bar: bool = True, reduce: str = "mean") -> None:
        """Record a metric: reduced across ranks (``reduce``: mean, sum, max, min) at each logging step,
        shown on the progress bar (``prog_bar``) and written to the CSV log under ``default_root_dir``.

        Log the same names on every rank: the reduction is one collective over all of them.
        """
        trainer: Attached | None = self.trainer
        if trainer is None:
            return
        trainer.log(name, value, prog_bar=prog_bar, reduce=reduce)

    def log_dict(self, metrics: dict[str, Any], *, prog_bar: bool = True, reduce: str = "mean") -> None:
        for name, value in metrics.items():
            self.log(name, value, prog_bar=prog_bar, reduce=reduce)

    @classmethod
    def overrides(cls, name: str) -> bool:
        return getattr(cls, name) is not getattr(Module, name)

    # test, predict, hyperparameters and loading ------------------------------------------------------
    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute test metrics of one batch (``Trainer.test``); log them with :meth:`log`."""
        raise NotImplementedError

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """The predictions of one batch (``Trainer.predict``); by default the module called on the batch.

        Return a tensor (or a dict, list or tuple of tensors) whose first dimension is the batch: predictions
        from several processes are put back in dataset order sample by sample.
        """
        return self(batch)

    def save_hyperparameters(self, *names: str, ignore: Iterable[str] | str | None = None) -> None:
        """Keep the arguments of this module's ``__init__`` (all, or ``names``, less ``ignore``) in
        :attr:`hparams` and in every checkpoint the Trainer writes, so that :meth:`load_from_checkpoint` can
        build the module again. Call it in ``__init__``. Plain values only (``None``, bool, int, float, str, and
        lists, tuples and dicts of them): checkpoints never hold pickled objects."""
        from stratagem.trainer import _hparams

        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            raise RuntimeError("save_hyperparameters() cannot see its caller's frame in this interpreter.")
        try:
            self.__dict__["_stratagem_hparams"] = _hparams.collect(caller, names, ignore)
            self.__dict__[_hparams.SAVED] = True
        finally:
            del frame, caller

    @property
    def hparams(self) -> Any:
        """What :meth:`save_hyperparameters` kept (a dict; ``hparams.name`` reads an entry too). Assigning it
        sets what loggers record as the model's hyperparameters, but only ``save_hyperparameters`` puts them in
        checkpoints."""
        from stratagem.trainer._hparams import HyperParameters

        return self.__dict__.setdefault("_stratagem_hparams", HyperParameters())

    @hparams.setter
    def hparams(self, value: Any) -> None:
        from stratagem.trainer import _hparams

        self.__dict__["_stratagem_hparams"] = value
        self.__dict__[_hparams.SAVED] = False

    @classmethod
    def load_from_checkpoint(cls, path: str | os.PathLike[str], **overrides: Any) -> Any:
        """Build this class from the hyperparameters a checkpoint stores (``overrides`` replace or add some),
        run :meth:`configure_model`, and load the checkpoint's weights: offline, in this process, from a full or
        sharded checkpoint written under any strategy, at a path or an object-store URL.

        Inside ``trainer.init_module(empty_init=True)`` the module is built on the meta device and takes the
        loaded tensors directly.
        """
        from stratagem.trainer import _hparams

        return _hparams.build(cls, path, overrides)

    # how a batch splits and how its loss is computed (the step of any strategy, pipelines included) ----
    def split_batch(self, batch: Any) -> tuple[tuple[Any, ...], Any]:
        """Return ``(inputs, targets)``: ``inputs`` a tuple of ``forward``'s positional arguments (the first
        dimension of each tensor the batch), ``targets`` what :meth:`compute_loss` compares outputs with.

        Under a pipeline the first stage reads ``inputs`` and the last stage ``targets``, each cut into
        micro-batches along the first dimension. The default takes a pair ``(x, y)`` as ``((x,), y)`` and a
        dict with ``"input_ids"`` as ``((batch["input_ids"],), batch.get("labels"))``.
        """
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return (batch[0],), batch[1]
        if isinstance(batch, dict) and "input_ids" in batch:
            return (batch["input_ids"],), batch.get("labels")
        raise ConfigurationError(
            f"{type(self).__name__}.split_batch cannot split a batch of type {type(batch).__name__}"
            + (f" with {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
            + ": the default takes (inputs, targets) pairs and dicts with 'input_ids'. Override "
            "split_batch(batch) to return (inputs_tuple, targets)."
        )

    def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Return the mean loss over the samples of ``outputs`` (a scalar tensor).

        Under a pipeline it runs on the last stage, once per micro-batch, and the batch's loss is the mean
        of those; so return a mean, not a sum. Do not call :meth:`log` here under a pipeline (the other stages
        would not log). The default calls ``self.loss_fn(outputs, targets)`` when the module has one.
        """
        loss_fn = getattr(self, "loss_fn", None)
        if not callable(loss_fn):
            raise NotImplementedError(
                f"{type(self).__name__} has no compute_loss(outputs, targets) and no loss_fn attribute."
            )
        return loss_fn(outputs, targets)


def defines_loss(module: Any) -> bool:
    """Whether ``module`` says how its loss is computed (:meth:`Module.compute_loss` or a ``loss_fn``)."""
    if not isinstance(module, Module):
        return False
    return type(module).compute_loss is not Module.compute_loss or callable(getattr(module, "loss_fn", None))


def step_functions(module: Any) -> tuple[Callable[[Any], Any], Callable[[Any, Any], torch.Tensor]]:
    """``module``'s ``split_batch`` and ``compute_loss`` (the defaults for a torch module that is not a Module)."""
    split = getattr(module, "split_batch", None) or functools.partial(Module.split_batch, module)
    compute = getattr(module, "compute_loss", None) or functools.partial(Module.compute_loss, module)
    return split, compute
