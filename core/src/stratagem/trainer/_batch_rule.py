"""Resuming at another world size or per-process batch: how many accumulation steps keep the samples per
optimizer step of the run that wrote the checkpoint, and where in the epoch's data to go on.

A checkpoint records what its run consumed per optimizer step (:class:`Consumption`). On resume the new run's is
compared with it. The optimizer's settings (learning rate, warm-up, schedule) were chosen for that many samples
per step, so the accumulation changes when that restores them; the user's settings stay where it cannot tell or
cannot restore them, and under ``Trainer(keep_global_batch=False)``. The position in the epoch follows samples:
the :class:`~stratagem.engine.sampler.EpochSampler` deals one order per epoch out to the ranks in turn, so the
samples a run has seen are the first ``samples_in_epoch`` of that order, whoever saw them, and the resumed run's
sampler begins at the next one. A checkpoint that does not record them (written before they were, or by a run
whose loader had a sampler of the user's own) counts ``batch_in_epoch x batch_size x world_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from stratagem.trainer._resume import Position


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
        batch = "no fixed size" if self.batch_size is None else str(self.batch_size)
        return f"{batch} x {self.world_size} process(es) x {self.accumulate} accumulated"


def continue_with(
    position: Position,
    saved: Any,
    run: Consumption,
    *,
    keep_global_batch: bool = True,
    starts_at_sample: bool = False,
) -> tuple[int, str | None]:
    """Decide how the resumed run goes on; move ``position`` to the same samples of the epoch.

    ``saved``: the checkpoint's ``topology`` record (None when it has none). ``starts_at_sample``: the run's
    train loader can begin the epoch at any sample (its sampler is an ``EpochSampler``); else it goes on at
    whole batches of its own. Returns the ``accumulate_grad_batches`` to train with and the one line to report
    (None when nothing changed).
    """
    if not isinstance(saved, Mapping) or "world_size" not in saved:
        return run.accumulate, None
    world_size, accumulate = int(saved["world_size"]), int(saved.get("accumulate_grad_batches", 1))
    if "batch_size" not in saved:
        return _without_batch_size(position, world_size, accumulate, run, keep_global_batch, starts_at_sample)
    size = saved["batch_size"]
    before = Consumption(None if size is None else int(size), world_size, accumulate)
    if (before.batch_size, before.world_size) == (run.batch_size, run.world_size):
        return run.accumulate, _same_processes(before, run)
    again = _follow_samples(position, before, run, starts_at_sample)
    accumulate, decision = _decide(before, run, keep_global_batch)
    return accumulate, f"stratagem: {_what_changed(before, run)}: {decision}{again}."


def _decide(before: Consumption, run: Consumption, keep_global_batch: bool) -> tuple[int, str]:
    """The accumulation for a run on other processes or batches, and what to say about it."""
    kept = f"accumulate_grad_batches={run.accumulate} is kept"
    if before.batch_size is None or run.batch_size is None:
        which = ["the checkpoint's run"] if before.batch_size is None else []
        which += ["this run's train loader"] if run.batch_size is None else []
        has = "have" if len(which) > 1 else "has"
        return run.accumulate, (
            f"{' and '.join(which)} {has} no fixed batch size, so the samples per step cannot be compared: "
            f"{kept} (position counted in batches)"
        )
    target, per_batch = before.samples_per_step, run.batch_size * run.world_size
    assert target is not None
    taken = per_batch * run.accumulate
    if target == taken:
        return run.accumulate, f"{target} samples per optimizer step as before ({run.describe()}): {kept}"
    if not keep_global_batch:
        return run.accumulate, (
            f"keep_global_batch=False, so {kept} and a step takes {taken} samples ({run.describe()}) where the "
            f"checkpoint's run took {target} ({before.describe()})"
        )
    if target % per_batch:
        return run.accumulate, (
            f"the checkpoint's run took {target} samples per step ({before.describe()}), which no whole number "
            f"of batches of {run.batch_size} x {run.world_size} process(es) makes: {kept} and a step takes "
            f"{taken} samples"
        )
    restored = attrs.evolve(run, accumulate=target // per_batch)
    return restored.accumulate, (
        f"keeping the checkpoint's {target} samples per optimizer step (accumulate_grad_batches "
        f"{run.accumulate} -> {restored.accumulate}: {restored.describe()}; Trainer(keep_global_batch=False) "
        "keeps the script's)"
    )


def _same_processes(before: Consumption, run: Consumption) -> str | None:
    """Same world size and per-process batch: an accumulation the script changed is its own choice."""
    if before.accumulate == run.accumulate:
        return None
    samples = ""
    if run.samples_per_step is not None:
        samples = f": {run.samples_per_step} samples per step where the checkpoint's run took "
        samples += str(before.samples_per_step)
    return (
        f"stratagem: accumulate_grad_batches {before.accumulate} -> {run.accumulate}, as the script asks (the "
        f"world size and per-process batch are the checkpoint's){samples}."
    )


def _without_batch_size(
    position: Position,
    world_size: int,
    accumulate: int,
    run: Consumption,
    keep_global_batch: bool,
    starts_at_sample: bool,
) -> tuple[int, str | None]:
    """A checkpoint written before the per-process batch was recorded."""
    if world_size == run.world_size:
        return run.accumulate, None
    if keep_global_batch:
        return continue_at_world_size(
            position, saved_world_size=world_size, saved_accumulate=accumulate, world_size=run.world_size
        )
    again = _follow_samples(position, Consumption(None, world_size, accumulate), run, starts_at_sample)
    return run.accumulate, (
        f"stratagem: world size changed from {world_size} to {run.world_size}: keep_global_batch=False, so "
        f"accumulate_grad_batches={run.accumulate} is kept{again}."
    )


def _what_changed(before: Consumption, run: Consumption) -> str:
    parts = []
    if before.world_size != run.world_size:
        parts.append(f"world size changed from {before.world_size} to {run.world_size}")
    if before.batch_size != run.batch_size:
        sizes = ["no fixed size" if b is None else b for b in (before.batch_size, run.batch_size)]
        parts.append(f"per-process batch changed from {sizes[0]} to {sizes[1]}")
    return ", ".join(parts)


def _follow_samples(position: Position, before: Consumption, run: Consumption, starts_at_sample: bool) -> str:
    """Move the position in the epoch to the samples consumed so far, in the new run's batches. A loader that
    begins at any sample goes on at the next one, its batches shifted from an uninterrupted run's; else the
    position rounds down to whole batches of the new run, and the line says how many samples are seen again."""
    consumed = position.samples_in_epoch
    if consumed is None and before.batch_size is not None:
        consumed = position.batch_in_epoch * before.batch_size * before.world_size
    if starts_at_sample and consumed is not None:
        position.samples_in_epoch = consumed
        # A loader without a batch_size yields its samples one by one: one sample per batch.
        per_batch = (run.batch_size or 1) * run.world_size
        position.batch_in_epoch, into = divmod(consumed, per_batch)
        if not into:
            return ""
        return (
            f"; this epoch goes on at its sample {consumed}, {into} sample(s) into a batch of {per_batch} of this "
            "run: its batches begin there"
        )
    position.samples_in_epoch = None
    if consumed is not None and run.batch_size is not None:
        per_batch, unit = run.batch_size * run.world_size, "sample(s)"
    else:  # no sizes to count samples with: count per-process batches, as if all were the same size
        consumed = position.batch_in_epoch * before.world_size
        per_batch, unit = run.world_size, "per-process batch(es)"
    position.batch_in_epoch, again = divmod(consumed, per_batch)
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
