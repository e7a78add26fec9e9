"""Exact resume: where training is (step, epoch, batches of the epoch consumed), and replaying the epoch's data
order and random streams to continue from the middle of an epoch bit for bit. Resuming at another world size
or per-process batch is :mod:`stratagem.trainer._batch_rule`'s."""

from __future__ import annotations

from typing import Any

import attrs

from stratagem.engine.data import loader_generators, set_epoch, skip_batches
from stratagem.engine.seed import capture_rng, restore_rng
from stratagem.errors import CheckpointError


@attrs.define
class Position:
    """Where training is: optimizer steps taken, epoch, and batches of this epoch consumed."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}


def start_epoch(loader: Any, position: Position, resume: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """An iterator over this epoch's batches and the epoch-start RNG state (saved with every checkpoint).

    ``resume`` holds what a checkpoint restored (``rng``, ``epoch_rng``) on the first epoch after loading it.
    """
    if resume is not None and position.batch_in_epoch > 0:
        # Re-create this epoch's order exactly: the RNG as the epoch began, the same iterator, skip what was
        # consumed; then the RNG as it was when the checkpoint was written.
        epoch_rng = resume.get("epoch_rng")
        if epoch_rng is None:
            raise CheckpointError(
                "(resume)", "stopped inside an epoch but holds no epoch-start RNG state to replay it."
            )
        _restore_epoch_rng(loader, epoch_rng)
        set_epoch(loader, position.epoch)
        iterator = iter(loader)
        skip_batches(iterator, position.batch_in_epoch)
        restore_rng(resume["rng"])
        return iterator, epoch_rng
    if resume is not None and resume.get("rng") is not None:
        restore_rng(resume["rng"])
    position.batch_in_epoch = 0
    epoch_rng = {"rng": capture_rng(), "generators": [g.get_state() for g in loader_generators(loader)]}
    set_epoch(loader, position.epoch)
    return iter(loader), epoch_rng


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
