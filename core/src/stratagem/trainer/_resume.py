"""Exact resume: where training is (step, epoch, batches and samples of the epoch consumed), and going on from
the middle of an epoch bit for bit: the epoch's order begun at the sample where the checkpoint stopped (or its
batches replayed and skipped, for a sampler of the user's own), the epoch's random streams replayed. Resuming at
another world size or per-process batch is :mod:`stratagem.trainer._batch_rule`'s."""

from __future__ import annotations

from typing import Any

import attrs

from stratagem.engine.data import loader_generators, set_epoch, skip_batches
from stratagem.engine.sampler import EpochSampler
from stratagem.engine.seed import capture_rng, restore_rng
from stratagem.errors import CheckpointError


@attrs.define
class Position:
    """Where training is: optimizer steps taken, epoch, batches of this epoch each process consumed, and the
    samples of the epoch all processes consumed together (``None`` when the train loader's sampler is not an
    :class:`~stratagem.engine.sampler.EpochSampler`, whose order is where they are counted)."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples_in_epoch: int | None = None

    def to_dict(self) -> dict[str, int]:
        progress = {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}
        if self.samples_in_epoch is not None:
            progress["samples_in_epoch"] = self.samples_in_epoch
        return progress

    @classmethod
    def from_dict(cls, progress: dict[str, Any]) -> Position:
        """A checkpoint's ``progress`` (written before ``samples_in_epoch`` was recorded, too)."""
        return cls(**{key: int(value) for key, value in progress.items() if value is not None})


@attrs.frozen
class Epoch:
    """This run's pass over an epoch: its batches, the ``batch_in_epoch`` at which they run out (None: a loader
    without a length), and how the samples consumed follow the batches (``sampler`` None: not counted)."""

    batches: Any
    end: int | None
    sampler: EpochSampler | None = None
    first_batch: int = 0  # the batch_in_epoch of the sampler's first sample
    batch_size: int = 1  # samples a process takes per batch

    def advance(self, position: Position, batch_in_epoch: int) -> None:
        position.batch_in_epoch = batch_in_epoch
        if self.sampler is None:
            position.samples_in_epoch = None
        else:
            taken = (batch_in_epoch - self.first_batch) * self.batch_size
            position.samples_in_epoch = self.sampler.consumed(taken)


def epoch_sampler(loader: Any) -> EpochSampler | None:
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, EpochSampler) else None


def start_epoch(
    loader: Any, position: Position, resume: dict[str, Any] | None
) -> tuple[Epoch, dict[str, Any]]:
    """This epoch's batches and the epoch-start RNG state (saved with every checkpoint).

    ``resume`` holds what a checkpoint restored (``rng``, ``epoch_rng``) on the first epoch after loading it.
    """
    sampler = epoch_sampler(loader)
    batch_size = (getattr(loader, "batch_size", None) or 1) if sampler is not None else 1
    inside = position.batch_in_epoch > 0 or bool(position.samples_in_epoch)
    if resume is not None and inside:
        # Re-create this epoch's order exactly: the RNG as the epoch began, the same iterator begun where the
        # checkpoint stopped; then the RNG as it was when the checkpoint was written.
        epoch_rng = resume.get("epoch_rng")
        if epoch_rng is None:
            raise CheckpointError(
                "(resume)", "stopped inside an epoch but holds no epoch-start RNG state to replay it."
            )
        _restore_epoch_rng(loader, epoch_rng)
        start, skip = _resume_point(loader, sampler, position, batch_size)
        _set_epoch(loader, sampler, position.epoch, start)
        batches = iter(loader)
        skip_batches(batches, skip)
        restore_rng(resume["rng"])
    else:
        if resume is not None and resume.get("rng") is not None:
            restore_rng(resume["rng"])
        position.batch_in_epoch, skip = 0, 0
        epoch_rng = {"rng": capture_rng(), "generators": [g.get_state() for g in loader_generators(loader)]}
        _set_epoch(loader, sampler, position.epoch, 0)
        batches = iter(loader)
    first = position.batch_in_epoch - skip
    length = loader_length(loader)
    epoch = Epoch(batches, None if length is None else first + length, sampler, first, batch_size)
    epoch.advance(position, position.batch_in_epoch)
    return epoch, epoch_rng


def _resume_point(
    loader: Any, sampler: EpochSampler | None, position: Position, batch_size: int
) -> tuple[int, int]:
    """Where the sampler begins the epoch and how many batches to skip after it; moves ``batch_in_epoch`` to
    the batch of this run that holds the next sample."""
    if sampler is None or position.samples_in_epoch is None:  # counted in batches: skip them
        return 0, position.batch_in_epoch
    samples = min(position.samples_in_epoch, sampler.size)
    per_batch = batch_size * sampler.num_replicas
    position.batch_in_epoch = samples // per_batch
    if getattr(loader, "num_workers", 0) > 0 and samples % per_batch == 0:
        # Worker processes draw their random streams batch after batch: fetch the consumed batches and drop
        # them, so that each worker is where it was in the run that wrote the checkpoint.
        return 0, position.batch_in_epoch
    return samples, 0


def _set_epoch(loader: Any, sampler: EpochSampler | None, epoch: int, start: int) -> None:
    if sampler is not None:
        sampler.set_epoch(epoch, start=start)
    else:
        set_epoch(loader, epoch)


def loader_length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _restore_epoch_rng(loader: Any, epoch_rng: dict[str, Any]) -> None:
    restore_rng(epoch_rng["rng"])
    generators = loader_generators(loader)
    saved = epoch_rng.get("generators") or []
    if len(saved) != len(generators):
        raise CheckpointError(
            "(resume)", "the train loader's random generators differ from those of the run being resumed."
        )
    for generator, state in zip(generators, saved):
        generator.set_state(state)
