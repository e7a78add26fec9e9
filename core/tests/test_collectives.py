"""Collectives of TorchDistributedStrategy over a real two-process gloo group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import core_workers

from stratagem import Engine


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collectives_over_gloo():
    engine = Engine(strategy=core_workers.PlainDistributed(), accelerator="cpu", devices=2, timeout=60)
    r = engine.launch(core_workers.collectives)
    assert r["world"] == 2 and r["rank"] == 0
    assert r["sum"] == [3.0, -1.0]
    assert r["mean"] == [1.5, -0.5]
    assert r["max"] == [2.0, 0.0]
    assert r["min"] == [1.0, -1.0]
    assert r["int_mean"] == [1.5]
    assert r["input_unchanged"]
    assert r["gather"] == [[[0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]
    assert r["gather_scalar"] == [0, 10]
    assert r["broadcast"] == {"from": 1, "items": [1, 1, 1]}
    assert r["group_before_teardown"] and not r["group_after_teardown"]


def test_single_process_collectives_are_identities():
    import torch

    engine = Engine(strategy="single_device", accelerator="cpu")
    t = torch.tensor([2.0, 3.0])
    assert engine.all_reduce(t, "sum").tolist() == [2.0, 3.0]
    assert [x.tolist() for x in engine.all_gather(t)] == [[2.0, 3.0]]
    assert engine.broadcast({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="use one of sum, mean, max, min"):
        engine.all_reduce(t, "avg")
