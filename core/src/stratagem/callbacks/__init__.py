"""Built-in callbacks: plugins of one Trainer (``Trainer(callbacks=[...])``) implementing its events.

- :class:`EarlyStopping`: stop when a monitored metric stops improving (every rank at the same step).
- :class:`ModelCheckpoint`: keep the best k checkpoints by a metric, plus ``last``.
- :class:`LearningRateMonitor`: log each optimizer's learning rates.
- :class:`Throughput`: log samples/s, tokens/s and model FLOPs utilisation.
- :class:`HFExport`: write the model as a Hugging Face folder at the end of ``fit`` (and every n steps).

Importing this package imports none of them, nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.callbacks._early_stopping import EarlyStopping
    from stratagem.callbacks._hf_export_callback import HFExport
    from stratagem.callbacks._model_checkpoint import ModelCheckpoint
    from stratagem.callbacks._run_metrics import LearningRateMonitor, Throughput

__all__ = ["EarlyStopping", "HFExport", "LearningRateMonitor", "ModelCheckpoint", "Throughput"]

_LAZY = {
    "EarlyStopping": "stratagem.callbacks._early_stopping",
    "HFExport": "stratagem.callbacks._hf_export_callback",
    "ModelCheckpoint": "stratagem.callbacks._model_checkpoint",
    "LearningRateMonitor": "stratagem.callbacks._run_metrics",
    "Throughput": "stratagem.callbacks._run_metrics",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
