"""Loggers: plugins that implement the logging events (``log_hyperparams``, ``log_metrics``, on global rank 0)
and close their runs at ``on_fit_end`` / ``on_exception``. ``Trainer(loggers=[...])`` takes these names or
instances: ``csv`` (the default), ``tensorboard``, ``mlflow``, ``wandb``; each tracker's client library is an
optional extra (``pip install "stratagem[tensorboard]"``) imported only when the logger first writes.

Importing this package imports none of them, nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.loggers._csv import CSVLogger
    from stratagem.loggers._mlflow import MLflowLogger
    from stratagem.loggers._tensorboard import TensorBoardLogger
    from stratagem.loggers._wandb import WandbLogger

__all__ = ["CSVLogger", "MLflowLogger", "TensorBoardLogger", "WandbLogger"]

_LAZY = {
    "CSVLogger": "stratagem.loggers._csv",
    "TensorBoardLogger": "stratagem.loggers._tensorboard",
    "MLflowLogger": "stratagem.loggers._mlflow",
    "WandbLogger": "stratagem.loggers._wandb",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
