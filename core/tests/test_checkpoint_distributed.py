"""Checkpoints across two real processes over gloo: failures agreed by every rank, and resharding 2 -> 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import _offline

sys.path.insert(0, str(Path(__file__).parent))
import ckpt_workers as W
from test_checkpoint import assert_same_payload


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_agree_on_failures_and_reshard_to_one(tmp_path: Path) -> None:
    engine = sg.Engine(strategy=W.ShardingTestStrategy(), accelerator="cpu", devices=2, timeout=120)
    result = engine.launch(W.failures_and_reshard, str(tmp_path))
    ranks = result["ranks"]
    assert len(ranks) == 2

    # Every failure raised CheckpointError on both ranks, naming the failing rank and its error.
    for rank, seen in enumerate(ranks):
        messages = seen["messages"]
        for fmt in ("full", "sharded"):
            message = messages[f"unsaveable-{fmt}"]
            assert message is not None, (rank, fmt)
            assert "rank 1: " in message and "state['extra'] is a builtins.object" in message, message
            assert "rank 0: " not in message, message
        sharded = messages["write-sharded"]
        assert sharded is not None and "rank 1" in sharded and "File too large" in sharded, sharded
        full = messages["write-full"]
        assert full is not None and "rank 0: " in full and "file size limit" in full, full
        assert "rank 1: " not in full, full
        # ... and left the previous checkpoints whole, with nothing beside them.
        assert seen["intact"] == {"good.pt": True, "good-dir": True}, (rank, seen["intact"])
        assert seen["leftovers"] == ["good-dir", "good.pt"], seen["leftovers"]

    # The sharded checkpoint really is split: each rank wrote its own shard file.
    assert sorted(p.name for p in (tmp_path / "good-dir").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    # Written at world size 2, it loads at world size 1 under single_device and equals the run's full save.
    single = sg.Engine(strategy="single_device", accelerator="cpu")
    reference = W.trained(seed=0)
    for name in ("good-dir", "good.pt"):
        model, optimizer = W.fresh()
        rest = single.load(tmp_path / name, {"model": model, "optimizer": optimizer})
        assert W.same_state((model, optimizer), reference), name
        assert rest["step"] == 3 and rest["rng"].tolist() == [0]

    out = _offline.consolidate(tmp_path / "good-dir", tmp_path / "consolidated.pt")
    got = torch.load(out, weights_only=True)
    want = torch.load(tmp_path / "good.pt", weights_only=True)
    assert (
        got["stratagem"]["world_size"] == 2 and got["stratagem"]["strategy"] == want["stratagem"]["strategy"]
    )
    assert_same_payload(got, want)
