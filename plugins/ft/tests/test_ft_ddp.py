"""``ft_ddp`` on real torchft (its lighthouse, Manager and gloo process groups), through the ``replica_groups``
launcher: two replica groups of one process each, one launch (a subprocess of ``ft_train.py`` under a timeout;
the tests read its records). Group 1's worker is killed at the end of step KILL_AT; its group restarts and
heals from the survivor. Steps 1 to KILL_AT are the run without failure, compared with data-parallel training
over the same global batch written out by hand in this process.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from ft_runs import data_parallel_reference, finish, full_loss, initial_params, rows, start

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

STEPS, KILL_AT = 20, 5
QUORUM_TIMEOUT = 20.0
FT = f"ft_ddp[num_replica_groups=2,quorum_timeout={QUORUM_TIMEOUT}]"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("killed")
    run = start(
        out,
        *("--strategy", FT, "--launcher", "replica_groups", "--steps", str(STEPS), "--max-restarts", "1"),
        *("--kill-group", "1", "--kill-at", str(KILL_AT), "--params-every-step"),
        # The survivor slows down while alone, so that the restart (a new interpreter importing torch, slow on
        # a loaded machine) still finds it training.
        *("--step-sleep", "0.1", "--sleep-while-alone", "3"),
    )
    return {"out": out, "output": finish(run, 300)}


def test_ft_ddp_without_failure_equals_data_parallel_training(killed: dict[str, Any]) -> None:
    out = killed["out"]
    reference = data_parallel_reference(KILL_AT)
    start_weights = initial_params()
    # The reference trained: a run that never did would pass the comparison below.
    moved = max((reference[k] - start_weights[k]).abs().max().item() for k in reference)
    assert moved > 1e-2, moved
    for group in (0, 1):
        weights = torch.load(out / f"group-{group}-attempt-0-step-{KILL_AT}.pt")
        assert weights.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=1e-5, msg=name)
    before = [[r for r in rows(out, group) if r["attempt"] == 0 and r["step"] <= KILL_AT] for group in (0, 1)]
    for records in before:
        assert [r["step"] for r in records] == list(range(1, KILL_AT + 1))
        assert all(r["participants"] == 2 and r["refused"] == 0 for r in records), records
    # Both groups hold the same weights after every step.
    assert [r["digest"] for r in before[0]] == [r["digest"] for r in before[1]]


def test_killed_group_costs_the_survivor_no_step(killed: dict[str, Any]) -> None:
    survivor = rows(killed["out"], 0)
    # Every step of the survivor committed, none refused, none missing: the job went on at step KILL_AT + 1.
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1)), survivor
    assert all(r["refused"] == 0 for r in survivor)
    assert [r["committed"] for r in survivor] == list(range(1, STEPS + 1))
    alone = [r for r in survivor if r["participants"] == 1]
    assert alone and alone[0]["step"] == KILL_AT + 1, survivor
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(survivor)]
    assert max(gaps) <= QUORUM_TIMEOUT + 2, gaps


def test_killed_group_rejoins_with_the_survivors_weights(killed: dict[str, Any]) -> None:
    out = killed["out"]
    survivor = {r["ft_step"]: r for r in rows(out, 0)}
    killed_rows = rows(out, 1)
    first = [r for r in killed_rows if r["attempt"] == 0]
    again = [r for r in killed_rows if r["attempt"] == 1]
    assert [r["step"] for r in first] == list(range(1, KILL_AT + 1))
    assert again, "the killed group never came back"
    rejoined = again[0]
    # Healed from the survivor: at its first step back it is at the job's step, with the same weights bit for bit.
    assert rejoined["ft_step"] in survivor and rejoined["ft_step"] > KILL_AT + 1
    mine = torch.load(out / f"group-1-attempt-1-step-{rejoined['step']}.pt")
    theirs = torch.load(out / f"group-0-attempt-0-step-{survivor[rejoined['ft_step']]['step']}.pt")
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
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
