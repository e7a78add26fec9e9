"""Collectives: results on every rank of a real multi-process run."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract._comparisons import compare, fail_on, section

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _expected_reduce(world: int) -> dict[str, list[float]]:
    values = [[r + 1.0, 2.0 * (r + 1), -(r + 1.0)] for r in range(world)]
    columns = list(zip(*values))
    return {
        "sum": [sum(c) for c in columns],
        "mean": [sum(c) / world for c in columns],
        "max": [max(c) for c in columns],
        "min": [min(c) for c in columns],
    }


def test_all_reduce(contract_run: Any) -> None:
    import torch

    world = contract_run.subject.world_size
    problems = []
    for rank, data in section(contract_run, 1, "collectives").items():
        for op, expected in _expected_reduce(world).items():
            got = data["all_reduce"][op]
            if not torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64)):
                problems.append(
                    f"rank {rank}: all_reduce(op={op!r}) of [r+1, 2(r+1), -(r+1)] over {world} ranks: "
                    f"expected {expected}, got {got.tolist()}"
                )
        total = world * (world + 1) // 2
        got = data["all_reduce_int_sum"]
        if got.tolist() != [total, 10 * total]:
            problems.append(
                f"rank {rank}: all_reduce(op='sum') of int64: expected {[total, 10 * total]}, got {got}"
            )
        if not data["input_unchanged"]:
            problems.append(f"rank {rank}: all_reduce changed its input tensor; expected it left as given")
    fail_on(problems, "all_reduce")


def test_all_gather_of_uneven_shapes(contract_run: Any) -> None:
    import torch

    world = contract_run.subject.world_size
    expected_1d = [torch.arange(r + 2, dtype=torch.float32) + 10 * r for r in range(world)]
    expected_2d = [torch.full((r + 1, 3), float(r)) for r in range(world)]
    problems = []
    for rank, data in section(contract_run, 1, "collectives").items():
        problems += compare(expected_1d, data["all_gather_1d"], f"rank {rank}: all_gather(arange(rank + 2))")
        problems += compare(
            expected_2d, data["all_gather_2d"], f"rank {rank}: all_gather(full((rank + 1, 3)))"
        )
    fail_on(problems, "all_gather")


def test_broadcast_of_an_object(contract_run: Any) -> None:
    world = contract_run.subject.world_size
    src = world - 1
    expected = {"sender": src, "items": [src] * 3, "text": f"from rank {src}"}
    problems = [
        f"rank {rank}: broadcast(obj, src={src}): expected {expected!r}, got {data['broadcast']!r}"
        for rank, data in section(contract_run, 1, "collectives").items()
        if data["broadcast"] != expected
    ]
    fail_on(problems, "broadcast")


def test_barrier_waits_for_every_rank(contract_run: Any) -> None:
    data = section(contract_run, 1, "collectives")
    arrived = data[0]["barrier_arrived"]
    problems = [
        f"rank {rank}: left the barrier {arrived - d['barrier_left']:.3f} s before rank 0 arrived at it; "
        "expected to wait for it"
        for rank, d in data.items()
        if d["barrier_left"] < arrived
    ]
    fail_on(problems, "barrier")
