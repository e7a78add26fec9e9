"""What each rank holds of a model's tensors (:class:`WeightShard`), found without gathering anything, and how
a held part maps onto a checkpoint tensor's byte runs.

The base strategy's ``weight_shards`` hook takes the sharded state dict (``module_state_dict(full=False)``):
a DTensor is one rectangle of its global tensor (``__create_chunk_list__``, what DCP plans with: FSDP, TP,
FSDP x TP, HSDP), a plain tensor the whole of it (DDP, one pipeline stage's tensors). A strategy that keeps
tensors another way returns its own shards, e.g. ranges of each flattened tensor (DeepSpeed ZeRO-3).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from stratagem.checkpoint._hf_names import Link
from stratagem.checkpoint._safetensors import runs


@attrs.define
class WeightShard:
    """This rank's part of one tensor of the model's state dict, as a live view: writing into ``tensor``
    changes the model (a load), reading it gives the model's values (an export).

    :param name: the tensor's name in the model's state dict (the unwrapped model's).
    :param shape: the whole tensor's shape.
    :param tensor: the part this rank holds; contiguous, on the CPU or a device.
    :param offsets: where ``tensor`` begins in the whole tensor, one offset per dimension (a rectangle of the
        whole tensor's shape); or ``None`` with ``flat_start``.
    :param flat_start: ``tensor`` (1-D) holds elements ``flat_start:flat_start + numel`` of the whole tensor
        flattened (a ZeRO-3 partition).
    """

    name: str
    shape: tuple[int, ...]
    tensor: torch.Tensor
    offsets: tuple[int, ...] | None = None
    flat_start: int | None = None

    def __attrs_post_init__(self) -> None:
        if (self.offsets is None) == (self.flat_start is None):
            raise ValueError(f"WeightShard {self.name!r}: give offsets or flat_start, not both or neither.")

    @property
    def region(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(view shape, offsets, sizes)``: a rectangle of the whole tensor, or of it flattened."""
        if self.offsets is not None:
            return self.shape, self.offsets, tuple(self.tensor.shape)
        return (math.prod(self.shape),), (self.flat_start or 0,), (self.tensor.numel(),)

    @property
    def key(self) -> tuple[Any, ...]:
        """The same on every rank that holds the same part (replicas), for choosing one writer."""
        _, offsets, sizes = self.region
        return (self.name, self.offsets is None, offsets, sizes)


def from_state_dict(state_dict: dict[str, Any]) -> list[WeightShard]:
    """The shards of a sharded state dict whose tensors share memory with the model (``state_dict()``
    detaches without copying): DTensors as rectangles, plain tensors whole."""
    shards = []
    # Where a DTensor's local part begins depends only on its global shape, mesh and placements: a model's
    # repeated blocks share a few of those, so each is worked out once (DTensor's own chunk list per tensor
    # was a tenth of a load's time outside the reads).
    offsets_of: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        if hasattr(value, "__create_chunk_list__") and hasattr(value, "to_local"):
            local = value.to_local()
            key = (tuple(value.shape), tuple(local.shape), id(value.device_mesh), tuple(value.placements))
            if key not in offsets_of or hasattr(local, "__create_chunk_list__"):
                chunks = value.__create_chunk_list__()
                if any(tuple(chunk.sizes) != tuple(local.shape) for chunk in chunks):
                    raise ValueError(f"{name}: a DTensor whose local tensor is not its one chunk")
                offsets_of[key] = [tuple(chunk.offsets) for chunk in chunks]
            shards += [WeightShard(name, tuple(value.shape), local, offsets=o) for o in offsets_of[key]]
        else:
            shards.append(WeightShard(name, tuple(value.shape), value, offsets=(0,) * value.dim()))
    return shards


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s own state dict with its live tensors (``keep_vars``), for a strategy whose wrapping keeps the
    model's module tree (FSDP2, tensor parallelism): the names :func:`from_state_dict` wants, without
    ``get_model_state_dict``'s pass over every parameter's names. A checkpoint wrapper's prefix is taken off
    by its own hook; ``torch.compile``'s is taken off here."""
    return {
        name.replace("_orig_mod.", ""): value
        for name, value in model.state_dict(keep_vars=True).items()
        if isinstance(value, torch.Tensor)
    }


def in_place_shards(model: torch.nn.Module, purpose: str, strategy: str) -> list[WeightShard]:
    """What a ``weight_shards`` hook returns for a strategy that shards the model in place (its parameters
    become DTensors under the model's own names: FSDP2, tensor parallelism), read from the model's own state
    dict; for a load, refused if they are copies. ``strategy`` names the strategy in that error."""
    shards = from_state_dict(module_tensors(model))
    if purpose == "load":
        check_live(shards, model, strategy)
    return shards


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


def check_live(shards: list[WeightShard], model: torch.nn.Module, strategy: str) -> None:
    """Refuse shards that are copies: loading into them would leave the model as it was."""
    live = {_storage(t) for t in (*model.parameters(), *model.buffers())}
    copies = [s.name for s in shards if s.tensor.numel() and _storage(s.tensor) not in live]
    if copies:
        from stratagem.errors import HookImplementationError

        raise HookImplementationError(
            f"{strategy}.module_state_dict(full=False) returns copies of {copies[:3]}, not the model's own "
            "tensors, so Hugging Face weights written into them would not reach the model. Implement the "
            "weight_shards hook to return live views (docs/hooks.md)."
        )


@attrs.frozen
class Transfer:
    """One read or write: ``local`` (a view of a shard's tensor) is the checkpoint tensor ``hf``'s elements at
    ``runs`` (element offsets, each ``length`` long, in ``local``'s row-major order)."""

    hf: str
    local: torch.Tensor
    starts: torch.Tensor
    length: int


def transfers(shard: WeightShard, link: Link, hf_shape: tuple[int, ...]) -> Iterator[Transfer]:
    """The part of ``shard`` that ``link`` covers, and where it is in checkpoint tensor ``link.hf``."""
    view_shape, offsets, sizes = shard.region
    if shard.flat_start is not None:
        yield from _flat_transfers(shard, link, hf_shape)
        return
    if not view_shape:  # a scalar
        yield Transfer(link.hf, shard.tensor, torch.zeros(1, dtype=torch.int64), 1)
        return
    d = link.dim
    begin, end = max(offsets[d], link.start), min(offsets[d] + sizes[d], link.stop)
    if begin >= end or 0 in sizes:
        return
    index = [slice(None)] * len(sizes)
    index[d] = slice(begin - offsets[d], end - offsets[d])
    local = shard.tensor[tuple(index)]
    hf_offsets = list(offsets)
    hf_offsets[d] = link.hf_start + begin - link.start
    hf_sizes = list(sizes)
    hf_sizes[d] = end - begin
    starts, length = runs(hf_shape, tuple(hf_offsets), tuple(hf_sizes))
    yield Transfer(link.hf, local, starts, length)


def _flat_transfers(shard: WeightShard, link: Link, hf_shape: tuple[int, ...]) -> Iterator[Transfer]:
    numel = math.prod(shard.shape)
    if hf_shape == shard.shape and link.whole and (not shard.shape or link.stop == shard.shape[link.dim]):
        lo, hi, hf_lo = 0, numel, 0
    elif math.prod(shard.shape[: link.dim]) == 1:
        # Along the first dimension that is not 1, a range of rows is one range of the flattened tensor.
        row = math.prod(shard.shape[link.dim + 1 :])
        lo, hi, hf_lo = link.start * row, link.stop * row, link.hf_start * row
    else:
        raise ValueError(
            f"{shard.name}: a shard that is a range of the flattened tensor (ZeRO-3) maps onto {link.hf} only "
            f"along the first dimension, not dim {link.dim}; load it under a strategy that keeps rectangles."
        )
    first = shard.flat_start or 0
    begin, end = max(first, lo), min(first + shard.tensor.numel(), hi)
    if begin < end:
        local = shard.tensor.reshape(-1)[begin - first : end - first]
        yield Transfer(link.hf, local, torch.tensor([hf_lo + begin - lo]), end - begin)
