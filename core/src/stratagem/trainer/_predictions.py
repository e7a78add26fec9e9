"""``Trainer.predict``'s data: the loader each process predicts on, and the predictions of every process put
back in dataset order on rank 0.

Each data-parallel rank predicts its share of a ``DistributedSampler`` without shuffling, which repeats the
first samples so that every rank gets as many batches (a sharded model runs its collectives in every forward,
so no rank may stop early). The sampler says which dataset index each prediction belongs to: rank 0 keeps one
prediction per index, in index order, and batches them as the user's loader would in one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from stratagem.errors import ConfigurationError

#: Per batch: the dataset indices it holds (``None`` when the sampler is the user's own) and its predictions.
Batches = list[tuple[list[int] | None, Any]]


def prediction_loader(loader: Any, num_replicas: int, rank: int) -> tuple[Any, list[list[int]] | None]:
    """The loader to predict on in this process, and the dataset indices of each of its batches (``None``
    where they cannot be known in advance: an iterable dataset, a sampler of the user's own)."""
    if not isinstance(loader, DataLoader) or type(loader.batch_sampler).__name__ != "BatchSampler":
        return loader, None
    sampler = loader.sampler
    if isinstance(sampler, (SequentialSampler, RandomSampler)):
        # Dataset order, no sample dropped: the predictions are those of the whole dataset.
        sampler = DistributedSampler(
            loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False
        )
        kwargs: dict[str, Any] = dict(
            batch_size=loader.batch_size,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=False,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
        )
        if loader.num_workers > 0:
            kwargs.update(
                prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context
            )
        loader = DataLoader(loader.dataset, **kwargs)
    elif not isinstance(sampler, DistributedSampler):
        return loader, None
    # A DistributedSampler's order depends only on its seed and epoch: the same when the loader runs.
    return loader, [list(batch) for batch in loader.batch_sampler]


def to_cpu(output: Any) -> Any:
    """Predictions off the device as they are made (a dataset's worth would not fit beside the model)."""
    if isinstance(output, torch.Tensor):
        if hasattr(output, "full_tensor"):  # a DTensor: every rank of its mesh predicts the same batch
            output = output.full_tensor()
        return output.detach().cpu()
    if isinstance(output, (list, tuple)):
        items = [to_cpu(item) for item in output]
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    if isinstance(output, dict):
        return {key: to_cpu(value) for key, value in output.items()}
    return output


def split_rows(output: Any, count: int) -> list[Any]:
    """One batch's predictions as ``count`` one-sample predictions (each keeps a leading dimension of 1)."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != count:
            raise ConfigurationError(
                f"predict_step returned a tensor of shape {tuple(output.shape)} for a batch of {count} samples. "
                "Under several processes the predictions are put back in dataset order sample by sample: return "
                "a tensor (or a dict, list or tuple of tensors) whose first dimension is the batch."
            )
        return [output[i : i + 1] for i in range(count)]
    if isinstance(output, dict):
        columns = {key: split_rows(value, count) for key, value in output.items()}
        return [{key: column[i] for key, column in columns.items()} for i in range(count)]
    if isinstance(output, (list, tuple)):
        columns_list = [split_rows(item, count) for item in output]
        rows = [[column[i] for column in columns_list] for i in range(count)]
        if hasattr(output, "_fields"):
            return [type(output)(*row) for row in rows]
        return [type(output)(row) for row in rows]
    raise ConfigurationError(
        f"predict_step returned a {type(output).__name__}. Under several processes the predictions are put back "
        "in dataset order sample by sample: return a tensor (or a dict, list or tuple of tensors) whose first "
        "dimension is the batch."
    )


def merge_rows(rows: list[Any]) -> Any:
    """The inverse of :func:`split_rows`: one batch from one-sample predictions."""
    first = rows[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(rows)
    if isinstance(first, dict):
        return {key: merge_rows([row[key] for row in rows]) for key in first}
    merged = [merge_rows([row[i] for row in rows]) for i in range(len(first))]
    return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)


def in_dataset_order(per_rank: list[Batches], batch_size: int | None) -> list[Any]:
    """Rank 0's result: one prediction per dataset index (the sampler's padding dropped), in index order,
    batched ``batch_size`` at a time (as the loader batches the dataset in one process)."""
    if any(indices is None for batches in per_rank for indices, _ in batches):
        # The user's own sampler: no index to order by. Each process's batches, in rank order.
        return [output for batches in per_rank for _, output in batches]
    rows: dict[int, Any] = {}
    for batches in per_rank:
        for indices, output in batches:
            assert indices is not None
            for index, row in zip(indices, split_rows(output, len(indices))):
                rows.setdefault(index, row)
    ordered = [rows[index] for index in sorted(rows)]
    size = batch_size or len(ordered)
    return [merge_rows(ordered[start : start + size]) for start in range(0, len(ordered), size)]
