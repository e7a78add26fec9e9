"""``EarlyStopping``: end ``fit`` when a validation metric has stopped improving."""

from __future__ import annotations

from typing import Any

from stratagem.callbacks._monitored_metric import better, check_mode, monitored_value
from stratagem.errors import ConfigurationError
from stratagem.hookspecs import hookimpl


class EarlyStopping:
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` validations in a row.

    The decision is rank 0's, from the metric reduced across ranks, broadcast to every rank: all ranks stop
    after the same step. Its counters go into checkpoints and come back on resume.

    :param monitor: a metric logged with ``self.log`` (a validation metric, or a training one).
    :param mode: ``"min"`` or ``"max"``.
    :param patience: validations without improvement before stopping.
    :param min_delta: the smallest change that counts as an improvement.
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ConfigurationError(f"EarlyStopping(monitor={monitor!r}): name a logged metric.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigurationError(f"EarlyStopping(patience={patience!r}): give a positive integer.")
        if min_delta < 0:
            raise ConfigurationError(f"EarlyStopping(min_delta={min_delta!r}): give 0 or a positive number.")
        self.monitor = monitor
        self.mode = check_mode("EarlyStopping", mode)
        self.patience = patience
        self.min_delta = float(min_delta)
        self.state_key = f"EarlyStopping[{monitor}]"
        self.best: float | None = None
        self.wait = 0
        self.stopped_step: int | None = None

    @hookimpl
    def on_validation_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        value = monitored_value("EarlyStopping", self.monitor, metrics, trainer)
        value = float(trainer.engine.broadcast(value, 0))  # rank 0's value decides for everyone
        if better(value, self.best, self.mode, self.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_step = trainer.global_step
            trainer.should_stop = True
            trainer.print(
                f"EarlyStopping: {self.monitor} has not improved on {self.best:.6g} for {self.wait} "
                f"validations; stopping at step {trainer.global_step}."
            )

    @hookimpl
    def on_save_checkpoint(self, state: dict[str, Any]) -> None:
        state.update(best=self.best, wait=self.wait, stopped_step=self.stopped_step)

    @hookimpl
    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        self.best, self.wait, self.stopped_step = state["best"], state["wait"], state["stopped_step"]
