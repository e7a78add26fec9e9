"""Functions that run inside worker processes started by the core tests (importable by spawned workers)."""

from __future__ import annotations

import torch

from stratagem.strategies import TorchDistributedStrategy


class PlainDistributed(TorchDistributedStrategy):
    """The base class alone: a process group and its collectives, no model wrapping."""


def collectives(engine) -> dict:
    rank, world = engine.rank, engine.world_size
    value = torch.tensor([float(rank + 1), -float(rank)])
    ints = torch.tensor([rank + 1])
    before = value.clone()
    result = {
        "rank": rank,
        "world": world,
        "sum": engine.all_reduce(value, "sum").tolist(),
        "mean": engine.all_reduce(value, "mean").tolist(),
        "max": engine.all_reduce(value, "max").tolist(),
        "min": engine.all_reduce(value, "min").tolist(),
        "int_mean": engine.all_reduce(ints, "mean").tolist(),
        "input_unchanged": torch.equal(before, value),
        "gather": [t.tolist() for t in engine.all_gather(torch.full((rank + 1, 2), float(rank)))],
        "gather_scalar": [t.item() for t in engine.all_gather(torch.tensor(rank * 10))],
        "broadcast": engine.broadcast({"from": rank, "items": [rank] * 3} if rank == 1 else None, src=1),
    }
    engine.barrier("end")
    import torch.distributed as dist

    result["group_before_teardown"] = dist.is_initialized()
    engine.teardown()
    result["group_after_teardown"] = dist.is_initialized()
    return result
