"""Resuming at another world size or per-process batch: how many accumulation steps keep the samples per
optimizer step of the run that wrote the checkpoint, and where in the epoch's data to go on.

A checkpoint records what its run consumed per optimizer step (:class:`Consumption`). On resume the new run's is
compared with it. The optimizer's settings (learning rate, warm-up, schedule) were chosen for that many samples
per step, so the accumulation changes when that restores them; the user's settings stay where it cannot tell or
cannot restore them, and under ``Trainer(keep_global_batch=False)``. The position in the epoch follows samples:
the distributed sampler deals an epoch's order out to the ranks in turn, so the samples a run has seen are the
first ``batch_in_epoch x batch_size x world_size`` of that order, whoever saw them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from stratagem._resume import Position


def loader_batch_size(loader: Any) -> int | None:
    """The per-process batch size of a loader (its ``batch_size`` or its batch sampler's); None when it has no
    fixed one (a batch sampler of varying sizes, a loader of ready-made batches, a plain iterable)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return None
    return size


@attrs.frozen
class Consumption:
    """What a run consumes per optimizer step: ``batch_size`` samples per process and batch (None: no fixed
    size), on ``world_size`` processes, ``accumulate`` batches per step."""

    batch_size: int | None
    world_size: int
    accumulate: int

    @property
    def samples_per_step(self) -> int | None:
        return None if self.batch_size is None else self.batch_size * self.world_size * self.accumulate

    def to_dict(self) -> dict[str, int | None]:
        return {
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "accumulate_grad_batches": self.accumulate,
            "samples_per_step": self.samples_per_step,
        }

    def describe(self) -> str:
        batch = "?" if self.batch_size is None else str(self.batch_size)
        total = "" if self.samples_per_step is None else f" = {self.samples_per_step}"
        return f"{batch} x {self.world_size} process(es) x {self.accumulate} accumulated{total}"


def continue_with(
    position: Position, saved: Any, run: Consumption, *, keep_global_batch: bool = True
) -> tuple[int, str | None]:
    """Decide how the resumed run goes on; move ``position`` to the same samples of the epoch.

    ``saved``: the checkpoint's ``topology`` record (None when it has none). Returns the
    ``accumulate_grad_batches`` to train with and the one line to report (None when nothing changed).
    """
    if not isinstance(saved, Mapping) or "world_size" not in saved:
        return run.accumulate, None
    world_size, accumulate = int(saved["world_size"]), int(saved.get("accumulate_grad_batches", 1))
    if "batch_size" not in saved:  # written before checkpoints recorded the per-process batch
        if world_size == run.world_size:
            return run.accumulate, None
        if keep_global_batch:
            return continue_at_world_size(
                position, saved_world_size=world_size, saved_accumulate=accumulate, world_size=run.world_size
            )
        before = Consumption(None, world_size, accumulate)
        again = _follow_samples(position, before, run)
        return run.accumulate, (
            f"stratagem: world size changed from {world_size} to {run.world_size}: keep_global_batch=False, so "
            f"accumulate_grad_batches={run.accumulate} is kept{again}."
        )
    size = saved["batch_size"]
    before = Consumption(None if size is None else int(size), world_size, accumulate)
    if (before.batch_size, before.world_size) == (run.batch_size, run.world_size):
        if before.accumulate == run.accumulate:
            return run.accumulate, None
        # Nothing about the processes changed: a different accumulation is the script's own choice.
        return run.accumulate, (
            f"stratagem: accumulate_grad_batches {before.accumulate} -> {run.accumulate}, as the script asks: "
            f"now {run.describe()} samples per step (the checkpoint's run: {before.describe()})."
        )
    again = _follow_samples(position, before, run)
    head = _what_changed(before, run)
    if before.batch_size is None or run.batch_size is None:
        which = "this run's train loader" if run.batch_size is None else "the checkpoint's run"
        return run.accumulate, (
            f"stratagem: {head}: {which} has no fixed batch size, so the samples per step cannot be compared: "
            f"accumulate_grad_batches={run.accumulate} is kept (position counted in batches){again}."
        )
    target, per_batch = before.samples_per_step, run.batch_size * run.world_size
    assert target is not None
    if target == per_batch * run.accumulate:
        return run.accumulate, (
            f"stratagem: {head}: {target} samples per optimizer step as before ({run.describe()}): "
            f"accumulate_grad_batches={run.accumulate} is kept{again}."
        )
    if not keep_global_batch:
        return run.accumulate, (
            f"stratagem: {head}: keep_global_batch=False, so accumulate_grad_batches={run.accumulate} is kept "
            f"and a step takes {run.describe()} samples (the checkpoint's run: {before.describe()}){again}."
        )
    if target % per_batch:
        return run.accumulate, (
            f"stratagem: {head}: the checkpoint's run took {before.describe()} samples per step, which no whole "
            f"number of batches of {run.batch_size} x {run.world_size} process(es) makes: "
            f"accumulate_grad_batches={run.accumulate} is kept and a step takes {run.describe()}{again}."
        )
    kept = attrs.evolve(run, accumulate=target // per_batch)
    return kept.accumulate, (
        f"stratagem: {head}: keeping the checkpoint's {target} samples per optimizer step "
        f"(accumulate_grad_batches {run.accumulate} -> {kept.accumulate}: {kept.describe()}; "
        f"Trainer(keep_global_batch=False) keeps the script's){again}."
    )


def _what_changed(before: Consumption, run: Consumption) -> str:
    parts = []
    if before.world_size != run.world_size:
        parts.append(f"world size changed from {before.world_size} to {run.world_size}")
    if before.batch_size != run.batch_size:
        parts.append(f"per-process batch changed from {before.batch_size} to {run.batch_size}")
    return ", ".join(parts)


def _follow_samples(position: Position, before: Consumption, run: Consumption) -> str:
    """Move the position in the epoch to the samples consumed so far, in the new run's batches; say how many
    are seen again when they do not fill whole batches of the new run."""
    if before.batch_size is not None and run.batch_size is not None:
        consumed = position.batch_in_epoch * before.batch_size * before.world_size
        per_batch, unit = run.batch_size * run.world_size, "sample(s)"
    else:  # no sizes to count samples with: count per-process batches, as if all were the same size
        consumed = position.batch_in_epoch * before.world_size
        per_batch, unit = run.world_size, "per-process batch(es)"
    position.batch_in_epoch = consumed // per_batch
    again = consumed - position.batch_in_epoch * per_batch
    return f"; {again} {unit} of this epoch are seen again" if again else ""


def continue_at_world_size(
    position: Position, *, saved_world_size: int, saved_accumulate: int, world_size: int
) -> tuple[int, str]:
    """The rule for checkpoints that do not record their per-process batch: keep the per-process batch and the
    global batch (counted in per-process batches) by changing the accumulation, where the new world size
    divides it; else keep the accumulation and let the global batch change with the world size."""
    global_batches = saved_world_size * saved_accumulate
    consumed = position.batch_in_epoch * saved_world_size
    position.batch_in_epoch = consumed // world_size
    change = f"world size changed from {saved_world_size} to {world_size}"
    if global_batches % world_size == 0:
        accumulate = global_batches // world_size
        return accumulate, (
            f"stratagem: {change}: keeping the global batch of {global_batches} per-rank batches per step "
            f"(accumulate_grad_batches {saved_accumulate} -> {accumulate}; the checkpoint does not record its "
            "per-process batch, which is taken to be unchanged)."
        )
    lost = consumed - position.batch_in_epoch * world_size
    repeated = f"; {lost} per-rank batch(es) of this epoch are seen again" if lost else ""
    return saved_accumulate, (
        f"stratagem: {change}: {global_batches} per-rank batches per step cannot be split over {world_size} "
        f"ranks, so each step now takes {world_size * saved_accumulate} (the per-rank batch and "
        f"accumulate_grad_batches={saved_accumulate} are kept){repeated}."
    )
