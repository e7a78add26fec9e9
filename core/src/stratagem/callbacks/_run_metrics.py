"""``LearningRateMonitor`` and ``Throughput``: metrics about the run itself, logged through ``trainer.log`` at
the Trainer's logging steps (so every logger gets them with the model's metrics)."""

from __future__ import annotations

import time
from typing import Any

from stratagem.errors import ConfigurationError
from stratagem.hookspecs import hookimpl


class LearningRateMonitor:
    """Log ``lr-<optimizer>/pg<group>`` (``lr-0/pg0``, ...) at each logging step: the learning rate each
    parameter group stepped with (read before the step's scheduler update)."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}

    @hookimpl
    def on_before_optimizer_step(self, trainer: Any, optimizer: Any) -> None:
        index = next(i for i, o in enumerate(trainer.optimizers) if o is optimizer)
        for g, group in enumerate(optimizer.param_groups):
            self._rates[f"lr-{index}/pg{g}"] = float(group["lr"])

    @hookimpl
    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if self._rates and trainer.is_logging_step:
            for name, value in self._rates.items():
                trainer.log(name, value, reduce="max")
            self._rates = {}


def _samples(batch: Any) -> int:
    """The batch's leading dimension: a tensor's, or the first tensor's inside a tuple, list or dict."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _samples(item)
        if found:
            return found
    return 0


class Throughput:
    """Log training throughput across all ranks at each logging step, over the steps since the previous one
    (validation and checkpoint time excluded):

    - ``throughput/samples_per_sec``: samples (the batch's leading dimension, summed over ranks) per second;
    - ``throughput/tokens_per_sec``: that times ``sequence_length``, when given;
    - ``throughput/mfu``: model FLOPs utilisation, ``flops_per_sample`` x samples/s over ``peak_flops`` x the
      number of ranks, when both are given (``peak_flops``: one device's peak, e.g. ``312e12`` for an A100 in
      bf16; ``flops_per_sample``: forward and backward, e.g. ``6 x parameters x sequence_length``).
    """

    def __init__(
        self,
        sequence_length: int | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        for name, value in (
            ("sequence_length", sequence_length),
            ("flops_per_sample", flops_per_sample),
            ("peak_flops", peak_flops),
        ):
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ConfigurationError(f"Throughput({name}={value!r}): give a positive number or None.")
        if (flops_per_sample is None) != (peak_flops is None):
            raise ConfigurationError(
                "Throughput: model FLOPs utilisation needs both flops_per_sample and peak_flops; give both or neither."
            )
        self.sequence_length = sequence_length
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self._start: float | None = None
        self._samples = 0
        self._paused = 0.0
        self._pause_start: float | None = None

    @hookimpl
    def on_fit_start(self) -> None:
        self._start, self._samples, self._paused = None, 0, 0.0

    @hookimpl
    def on_train_batch_start(self) -> None:
        if self._start is None:  # the clock starts with the first batch, not with the loggers' set-up
            self._start = time.perf_counter()

    @hookimpl
    def on_train_batch_end(self, trainer: Any, batch: Any) -> None:
        self._samples += _samples(batch)
        if not trainer.is_logging_step or self._start is None:
            return
        now = time.perf_counter()
        elapsed = now - self._start - self._paused
        if elapsed <= 0:
            return
        # Each rank logs its own rate and the reduction sums them: the global rate.
        rate = self._samples / elapsed
        trainer.log("throughput/samples_per_sec", rate, reduce="sum")
        if self.sequence_length is not None:
            trainer.log("throughput/tokens_per_sec", rate * self.sequence_length, reduce="sum")
        if self.flops_per_sample is not None and self.peak_flops is not None:
            world = trainer.engine.world_size
            trainer.log(
                "throughput/mfu", rate * self.flops_per_sample / (self.peak_flops * world), reduce="sum"
            )
        self._start, self._samples, self._paused = now, 0, 0.0

    @hookimpl
    def on_validation_start(self) -> None:
        self._pause_start = time.perf_counter()

    @hookimpl
    def on_validation_end(self) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None
