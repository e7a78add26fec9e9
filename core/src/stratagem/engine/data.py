"""Giving data loaders the epoch's order and this rank's share of it, and resuming them mid-epoch."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from stratagem.engine.sampler import EpochSampler


def distribute_loader(loader: Any, sampler_kwargs: dict[str, int], *, seed: int = 0) -> Any:
    """A copy of ``loader`` whose sampler is an :class:`EpochSampler` over this rank's share, or ``loader`` where
    the user has decided how to sample.

    A loader that takes its data set in order or shuffled gets one at every world size, one process included:
    the epoch's order then depends on ``seed`` and the epoch alone, so a run resumed at another world size
    goes on with the same order. A sampler or batch sampler of the user's own is left alone, and so is a
    ``RandomSampler`` that draws with replacement or another number of samples than the data set holds,
    where one process needs no split (with several, it is replaced as before: ranks drawing on their own
    would draw the same samples).
    """
    if not isinstance(loader, DataLoader):
        return loader
    sampler, replicas = loader.sampler, sampler_kwargs.get("num_replicas", 1)
    if isinstance(sampler, DistributedSampler) or not isinstance(sampler, (RandomSampler, SequentialSampler)):
        return loader
    if loader.batch_size is None and loader.batch_sampler is not None:  # a batch sampler of the user's own
        return loader
    if replicas <= 1 and isinstance(sampler, RandomSampler) and not _a_permutation(sampler):
        return loader
    distributed = EpochSampler(
        loader.dataset,  # type: ignore[arg-type]
        shuffle=isinstance(sampler, RandomSampler),
        seed=seed,
        drop_last=loader.drop_last,
        num_replicas=replicas,
        rank=sampler_kwargs.get("rank", 0),
    )
    return rebuild_loader(loader, sampler=distributed)


def _a_permutation(sampler: RandomSampler) -> bool:
    return not sampler.replacement and sampler.num_samples == len(sampler.data_source)


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
