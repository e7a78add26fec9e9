"""``ft_ddp`` on real torchft (its lighthouse, Manager and gloo process groups), through the ``replica_groups``
launcher: two replica groups of one process each.

Launch A: ``ft_ddp`` with no failure, beside ``ddp`` on two processes over the same global batch (the reference,
launched at the same time). Launch B: one group's worker killed at step 10 of 30; its group restarts and heals
from the survivor. Each launch is a subprocess of ``ft_train.py`` under a timeout; the tests read its records.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from ft_runs import finish, full_loss, initial_params, rows, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS = 20
KILL_STEPS, KILL_AT = 30, 10
QUORUM_TIMEOUT = 20.0
FT = f"ft_ddp[num_replica_groups=2,quorum_timeout={QUORUM_TIMEOUT}]"


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("plain")
    ft = start(root / "ft", "--strategy", FT, "--launcher", "replica_groups", "--steps", str(STEPS))
    ddp = start(root / "ddp", "--strategy", "ddp", "--devices", "2", "--steps", str(STEPS))
    outputs = {"ft": finish(ft, 300), "ddp": finish(ddp, 300)}
    return {"root": root, "outputs": outputs}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("killed")
    run = start(
        out,
        *("--strategy", FT, "--launcher", "replica_groups", "--steps", str(KILL_STEPS)),
        *(
            "--max-restarts",
            "1",
            "--kill-group",
            "1",
            "--kill-at",
            str(KILL_AT),
            "--step-sleep",
            "0.3",
            "--sleep-while-alone",
            "3",
        ),
    )
    return {"out": out, "output": finish(run, 400)}


def test_ft_ddp_without_failure_equals_ddp(plain: dict[str, Any]) -> None:
    root = plain["root"]
    reference = torch.load(root / "ddp" / "final-0.pt")
    start_weights = initial_params()
    # The reference trained: a run that never did would pass the comparison below.
    moved = max((reference[k] - start_weights[k]).abs().max().item() for k in reference)
    assert moved > 1e-2, moved
    for group in (0, 1):
        final = torch.load(root / "ft" / f"final-{group}.pt")
        assert final.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(final[name], reference[name], rtol=0, atol=1e-5, msg=name)
    for group in (0, 1):
        records = rows(root / "ft", group)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert all(r["participants"] == 2 and r["refused"] == 0 for r in records), records
    # Both groups hold the same weights after every step.
    assert [r["digest"] for r in rows(root / "ft", 0)] == [r["digest"] for r in rows(root / "ft", 1)]


def test_killed_group_costs_the_survivor_no_step(killed: dict[str, Any]) -> None:
    survivor = rows(killed["out"], 0)
    # Every step of the survivor committed, none refused, none missing: the job went on at step KILL_AT + 1.
    assert [r["step"] for r in survivor] == list(range(1, KILL_STEPS + 1)), survivor
    assert all(r["refused"] == 0 for r in survivor)
    assert [r["committed"] for r in survivor] == list(range(1, KILL_STEPS + 1))
    alone = [r for r in survivor if r["participants"] == 1]
    assert alone and alone[0]["step"] == KILL_AT + 1, survivor
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(survivor)]
    assert max(gaps) <= QUORUM_TIMEOUT + 2, gaps


def test_killed_group_rejoins_with_the_survivors_weights(killed: dict[str, Any]) -> None:
    survivor = {r["ft_step"]: r for r in rows(killed["out"], 0)}
    killed_rows = rows(killed["out"], 1)
    first = [r for r in killed_rows if r["attempt"] == 0]
    again = [r for r in killed_rows if r["attempt"] == 1]
    assert [r["step"] for r in first] == list(range(1, KILL_AT + 1))
    assert again, "the killed group never came back"
    rejoined = again[0]
    # Healed from the survivor: at its first step back it is at the job's step, with the same weights bit for bit.
    assert rejoined["ft_step"] in survivor and rejoined["ft_step"] > KILL_AT + 1
    assert rejoined["digest"] == survivor[rejoined["ft_step"]]["digest"]
    assert survivor[rejoined["ft_step"] + 1]["participants"] == 2
    for row in again:
        if row["ft_step"] in survivor:
            assert row["digest"] == survivor[row["ft_step"]]["digest"], row


def test_killed_run_trains_and_reads_no_checkpoint(killed: dict[str, Any]) -> None:
    # On the whole data set, not one batch's noisy loss.
    for group in (0, 1):
        assert full_loss(torch.load(killed["out"] / f"final-{group}.pt")) < 0.5 * full_loss(initial_params())
    assert "restarting the workers (1 of 1 restarts)" in killed["output"]
    assert "No checkpoint under" in killed["output"]
    assert not list(killed["out"].rglob("*.distcp")) and not list(killed["out"].rglob("checkpoints/*"))
