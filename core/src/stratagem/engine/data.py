"""Giving data loaders a distributed sampler, and resuming them mid-epoch."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler


def distribute_loader(loader: Any, sampler_kwargs: dict[str, int], *, seed: int = 0) -> Any:
    """A copy of ``loader`` whose sampler splits the data across ranks, or ``loader`` if it needs none.

    A loader with a sampler of the user's own (or a batch sampler) is left alone: the user has decided.
    """
    if not isinstance(loader, DataLoader) or sampler_kwargs.get("num_replicas", 1) <= 1:
        return loader
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler) or not isinstance(sampler, (RandomSampler, SequentialSampler)):
        return loader
    if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
        return loader
    distributed = DistributedSampler(
        loader.dataset,
        shuffle=isinstance(sampler, RandomSampler),
        seed=seed,
        drop_last=loader.drop_last,
        **sampler_kwargs,
    )
    return rebuild_loader(loader, sampler=distributed)


def rebuild_loader(loader: DataLoader, sampler: Sampler) -> DataLoader:
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(loader.dataset, **kwargs)


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's sampler which epoch it is (shuffles differ per epoch, identically on every rank)."""
    for holder in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        if holder is not None and hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)


def seeded_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a loader draws its order and worker seeds from (each once)."""
    holders = [
        loader,
        getattr(loader, "sampler", None),
        getattr(loader, "batch_sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ]
    found: dict[int, torch.Generator] = {}
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator):
            found.setdefault(id(generator), generator)
    return list(found.values())


def skip_batches(iterator: Any, count: int) -> int:
    """Advance a loader's iterator by ``count`` batches; return how many were skipped (fewer at the end).

    A single-process loader skips at the sampler, without loading the data; worker processes have been
    handed indices already, so their batches are fetched and dropped.
    """
    skipped = 0
    sampler_iter = getattr(iterator, "_sampler_iter", None)
    fast = type(iterator).__name__ == "_SingleProcessDataLoaderIter" and sampler_iter is not None
    while skipped < count:
        try:
            if fast:
                next(sampler_iter)
                iterator._num_yielded += 1
            else:
                next(iterator)
        except StopIteration:
            break
        skipped += 1
    return skipped
