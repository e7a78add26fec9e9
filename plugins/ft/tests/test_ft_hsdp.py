"""``ft_hsdp`` on real torchft: two replica groups of two processes each (FSDP2 inside each group), one launch
in which group 1's rank 0 is killed at step 5 of 20: its whole group restarts (torch's elastic agent) and each
of its ranks heals its shards from the same rank of the survivor."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_runs import finish, full_loss, initial_params, rows, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

STEPS, KILL_AT, QUORUM_TIMEOUT = 20, 5, 20.0
# The killed group's other rank waits on its dead rank 0's Manager for `timeout` seconds before it fails and
# its agent restarts the group; 5 s (not the default 60) keeps the restart within the survivor's steps.
FT = f"ft_hsdp[num_replica_groups=2,quorum_timeout={QUORUM_TIMEOUT},timeout=5]"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hsdp")
    run = start(
        out,
        *("--strategy", FT, "--devices", "2"),
        *("--launcher", "replica_groups", "--steps", str(STEPS), "--max-restarts", "1"),
        *("--kill-group", "1", "--kill-at", str(KILL_AT), "--step-sleep", "0.1", "--sleep-while-alone", "3"),
    )
    return {"out": out, "output": finish(run, 360)}


def test_the_survivor_loses_no_step(killed: dict[str, Any]) -> None:
    survivor = rows(killed["out"], 0)
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1)), survivor
    assert all(r["refused"] == 0 for r in survivor)
    alone = [r for r in survivor if r["participants"] == 1]
    assert alone and alone[0]["step"] == KILL_AT + 1, survivor
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(survivor)]
    assert max(gaps) <= QUORUM_TIMEOUT + 2, gaps


def test_the_killed_group_heals_its_shards_bit_for_bit(killed: dict[str, Any]) -> None:
    out: Path = killed["out"]
    survivor = {r["ft_step"]: r for r in rows(out, 0)}
    again = [r for r in rows(out, 1) if r["attempt"] == 1]
    assert again, "the killed group never came back"
    # The digest is of the gathered parameters: every shard of the group equals the survivor's.
    assert again[0]["ft_step"] in survivor
    assert again[0]["digest"] == survivor[again[0]["ft_step"]]["digest"]
    assert all(r["digest"] == survivor[r["ft_step"]]["digest"] for r in again if r["ft_step"] in survivor)


def test_it_trains_and_reads_no_checkpoint(killed: dict[str, Any]) -> None:
    for group in (0, 1):
        assert full_loss(torch.load(killed["out"] / f"final-{group}.pt")) < 0.5 * full_loss(initial_params())
    assert "No checkpoint under" in killed["output"]
    assert not list(killed["out"].rglob("checkpoints/*"))
