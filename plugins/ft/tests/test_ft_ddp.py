"""``ft_ddp`` on real torchft (its lighthouse, Manager and gloo process groups), through the ``replica_groups``
launcher: two replica groups of one process each. One module fixture starts two launches at once (subprocesses
of ``ft_train.py`` under a timeout; the tests read their records). In the first, group 1's worker is killed at
the end of step KILL_AT, and its group restarts and heals from the survivor; its steps 1 to KILL_AT are compared
with data-parallel training written out by hand in this process. The second runs without failure, alongside
(the first spends most of its time asleep), and is compared with the same job under stratagem's ``ddp`` on two
processes, launched meanwhile from this process; its group 0 ends with a quorum left open.
"""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_runs import data_parallel_reference, ddp_run, finish, full_loss, initial_params, rows, start

import stratagem as sg

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

STEPS, KILL_AT = 20, 5
QUORUM_TIMEOUT = 20.0
FT = f"ft_ddp[num_replica_groups=2,quorum_timeout={QUORUM_TIMEOUT}]"


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out, free_out = tmp_path_factory.mktemp("killed"), tmp_path_factory.mktemp("free")
    runs = [
        start(
            out,
            *("--strategy", FT, "--launcher", "replica_groups", "--steps", str(STEPS), "--max-restarts", "1"),
            *("--kill-group", "1", "--kill-at", str(KILL_AT), "--params-every-step"),
            # The survivor slows down while alone, so that the restart (a new interpreter importing torch, slow
            # on a loaded machine) still finds it training.
            *("--step-sleep", "0.1", "--sleep-while-alone", "3"),
        ),
        start(
            free_out,
            *(
                "--strategy",
                FT,
                "--launcher",
                "replica_groups",
                "--steps",
                str(STEPS),
                "--forward-at-end",
                "0",
            ),
        ),
    ]
    try:
        ddp = sg.Engine(strategy="ddp", accelerator="cpu", devices=2).launch(ddp_run, STEPS)
    except BaseException:
        for run in runs:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
        raise
    return {
        "killed": {"out": out, "output": finish(runs[0], 300)},
        "free": {"out": free_out, "output": finish(runs[1], 120), "ddp": ddp},
    }


@pytest.fixture(scope="module")
def killed(launches: dict[str, Any]) -> dict[str, Any]:
    return launches["killed"]


@pytest.fixture(scope="module")
def free(launches: dict[str, Any]) -> dict[str, Any]:
    return launches["free"]


def test_ft_ddp_without_failure_ends_within_1e_5_of_ddp(free: dict[str, Any]) -> None:
    out: Path = free["out"]
    reference = free["ddp"]
    # The reference trained: a run that never did would fail the comparison below.
    start_weights = initial_params()
    moved = max((reference[k] - start_weights[k]).abs().max().item() for k in reference)
    assert moved > 1e-2, moved
    for group in (0, 1):
        records = rows(out, group)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
        assert all(r["participants"] == 2 and r["refused"] == 0 for r in records), records
        weights = torch.load(out / f"final-{group}.pt")
        assert weights.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=1e-5, msg=name)


def test_a_quorum_left_open_at_the_end_does_not_hold_the_exit(free: dict[str, Any]) -> None:
    # Group 0 ran one more forward after its last step (opening a quorum that no step takes) and tore down before
    # its process exited. The lighthouse answers that quorum once group 1, ended, is dropped (its heartbeat and
    # join timeouts, 5 s each); shut down before the answer, the Manager held the exit for all of quorum_timeout.
    out: Path = free["out"]
    ended = float((out / "ended-0").read_text()) - rows(out, 0)[-1]["time"]
    assert ended < QUORUM_TIMEOUT, ended


def test_ft_ddp_before_the_failure_equals_data_parallel_training_by_hand(killed: dict[str, Any]) -> None:
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
