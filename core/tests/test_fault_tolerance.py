"""Restarts after a failure, with the result of an uninterrupted run: a rank that raises once is retried, one
that always raises ends the run after N restarts, a hang is detected and named, a crash in the middle of a
save resumes from the previous complete checkpoint; bad input is refused. Real 2-process runs under torch's
elastic agent (the in-test gradient-averaging strategy; ddp and fsdp are in tests/test_fault_tolerance.py)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import stratagem as sg
from stratagem.errors import ConfigurationError

WORKLOADS = Path(__file__).parent / "workloads"
SCRIPT = WORKLOADS / "sg_workloads.py"
sys.path.insert(0, str(WORKLOADS))
import sg_workloads as wl  # noqa: E402

STEPS = 8


@pytest.fixture(autouse=True)
def _watched_temp_dir(temp_dir) -> None:
    """Every run of this module gets a fresh temporary directory, which _run checks is empty afterwards."""


def _run(root: Path, *extra: str, timeout: float = 150) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, str(SCRIPT), "--devices", "2", "--steps", str(STEPS), "--optimizer", "adamw"]
    command += ["--shuffle", "--root", str(root), "--out", str(root / "out"), *extra]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    elapsed = time.monotonic() - start
    time.sleep(0.3)
    assert wl.processes_mentioning(str(root)) == [], "a worker outlived the run"
    # Whether it succeeded, restarted, gave up or was ended by the hang watchdog.
    left = sorted(p.name for p in Path(os.environ["TMPDIR"]).iterdir())
    assert left == [], f"the run left these in the temporary directory: {left}"
    return done, elapsed


def _params(root: Path) -> dict[str, torch.Tensor]:
    (result,) = torch.load(f"{root / 'out'}.rank0", weights_only=False)
    return result["params"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, watch_temp_dir: Any) -> dict[str, torch.Tensor]:
    """The parameters of the uninterrupted run (a checkpoint every 2 steps) that every restarted run must end
    with, bit for bit: one run serves the module, checked as each test's own runs are (a temporary directory of
    its own, left empty)."""
    root = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as patch:
        watch_temp_dir(root, patch)
        done, _ = _run(root / "run", "--ckpt-every", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    return _params(root / "run")


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_restarts_resume_as_if_nothing_had_failed(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    want = reference

    # A transient error on rank 1 at step 3: one restart, resumed from step 2, one step lost.
    once, _ = _run(tmp_path / "once", "--ckpt-every", "2", "--max-restarts", "2", "--faults", "0:1:3:raise")
    assert once.returncode == 0, once.stderr[-3000:]
    _assert_bit_equal(_params(tmp_path / "once"), want)
    assert "restarting the workers (1 of 2 restarts)" in once.stderr
    assert (
        "restart 1 of 2: rank 1 RuntimeError: deliberate failure on rank 1 at step 3; resumed from step 2"
        in (once.stdout)
    ), once.stdout
    assert "this run was restarted 1 time(s)" in once.stdout
    # The metrics count the restart from the first row written after it (step 4 is logged after the resume).
    with open(tmp_path / "once" / "run0" / "metrics.csv") as rows:
        restarts = {
            int(row["step"]): float(row["restarts"]) for row in csv.DictReader(rows) if row["restarts"]
        }
    assert restarts == {2: 0.0, 4: 1.0, 6: 1.0, 8: 1.0}, restarts

    # Killed just before the step-4 checkpoint is published: the restart takes step 2's, never the torn one.
    torn, _ = _run(
        tmp_path / "torn", "--ckpt-every", "2", "--max-restarts", "1", "--faults", "0:0:4:save-kill"
    )
    assert torn.returncode == 0, torn.stderr[-3000:]
    assert "rank 0 killed by signal SIGKILL" in torn.stderr
    assert "resumed from step 2" in torn.stdout, torn.stdout
    _assert_bit_equal(_params(tmp_path / "torn"), want)

    # A hang on rank 1: the watchdog names it within the timeout, the group restarts and finishes.
    hung, _ = _run(
        tmp_path / "hung",
        *("--ckpt-every", "2", "--max-restarts", "1", "--faults", "0:1:5:hang", "--timeout", "6"),
    )
    assert hung.returncode == 0, hung.stderr[-3000:]
    assert "rank 1 stopped making progress" in hung.stderr, hung.stderr[-3000:]
    _assert_bit_equal(_params(tmp_path / "hung"), want)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_failures_that_restarts_cannot_fix_end_the_run_naming_the_rank(tmp_path: Path) -> None:
    always, _ = _run(
        tmp_path / "always", "--ckpt-every", "2", "--max-restarts", "2", "--faults", "*:1:3:raise"
    )
    assert always.returncode != 0
    assert "rank 1" in always.stderr and "gave up after 2 restart(s)" in always.stderr, always.stderr[-3000:]
    for attempt in (1, 2):  # the restarts really happened before it gave up
        assert f"restarting the workers ({attempt} of 2 restarts)" in always.stderr, always.stderr[-3000:]
    assert always.stderr.count("Traceback (most recent call last)") == 1, always.stderr[-5000:]

    hung, elapsed = _run(tmp_path / "hang", "--faults", "*:1:3:hang", "--timeout", "6")
    assert hung.returncode != 0
    assert "Training failed: rank 1" in hung.stderr and "rank 1 stopped making progress" in hung.stderr, (
        hung.stderr[-3000:]
    )
    assert "time.sleep" in hung.stderr or "hang" in hung.stderr  # the hung thread's stack is shown
    assert elapsed < 60


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_checkpoints_on_the_clock_are_written_by_every_rank_at_one_step(tmp_path: Path) -> None:
    """checkpoint_every_n_minutes: rank 0's clock decides, every rank saves at that step (a full save gathers
    each rank's RNG state, so a rank that did not join would show as a missing entry or a hang)."""
    done, _ = _run(tmp_path / "clock", "--ckpt-minutes", "0.01", "--step-sleep", "0.25")
    assert done.returncode == 0, done.stderr[-3000:]
    saved = sorted((tmp_path / "clock" / "run0" / "checkpoints").glob("step-*.ckpt"))
    steps = [int(path.name[len("step-") : -len(".ckpt")]) for path in saved]
    # At least 0.25 s a step: 0.6 s of training passes by step 3 and again by step 6; the last is fit's own.
    assert len(steps) >= 3 and steps[-1] == STEPS and steps[0] <= 3, steps
    for path, step in zip(saved, steps):
        checkpoint = torch.load(path, weights_only=True)
        assert checkpoint["state"]["progress"]["step"] == step
        assert len(checkpoint["state"]["rng"]["__stratagem_per_rank__"]) == 2, path


def test_bad_restart_options_are_refused_before_anything_runs(tmp_path: Path, stratagem_cli) -> None:
    with pytest.raises(ConfigurationError, match="max_restarts=-1"):
        sg.Trainer(max_restarts=-1, checkpoint_every_n_steps=1)
    with pytest.raises(ConfigurationError, match="start again from step 0") as caught:
        sg.Trainer(max_restarts=2)
    assert "restart_from_scratch=True" in str(caught.value)
    sg.Trainer(max_restarts=2, restart_from_scratch=True)
    sg.Trainer(max_restarts=2, checkpoint_every_n_minutes=0.5)
    with pytest.raises(ConfigurationError, match="checkpoint_every_n_minutes=0"):
        sg.Trainer(checkpoint_every_n_minutes=0)
    with pytest.raises(ConfigurationError, match="max_restarts"):
        sg.Engine(max_restarts=-1)
    # Restarts asked of the launcher (torch's agent tells its workers; stratagem's says the same): the script's
    # Trainer checks them as its own.
    for variable in ("TORCHELASTIC_MAX_RESTARTS", "STRATAGEM_MAX_RESTARTS"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(variable, "3")
            with pytest.raises(ConfigurationError, match=r"--max-restarts 3 of the launcher.*step 0"):
                sg.Trainer()
            sg.Trainer(checkpoint_every_n_steps=5)
            sg.Trainer(restart_from_scratch=True)
    for args, message in (
        (["--nnodes", "3:2"], "--nnodes '3:2'"),
        (["--nnodes", "a"], "--nnodes 'a'"),
        (["--max-restarts", "-1"], "max_restarts=-1"),
    ):
        script = tmp_path / "train.py"
        script.write_text("raise SystemExit('should not run')\n")
        done = stratagem_cli("run", *args, str(script))
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_changed_world_size_keeps_the_global_batch_where_it_divides() -> None:
    # The rule for checkpoints that do not record their per-process batch (test_batch_rule.py: the others).
    from stratagem.trainer._batch_rule import continue_at_world_size
    from stratagem.trainer._resume import Position

    shrunk = Position(step=4, epoch=0, batch_in_epoch=6)  # 6 batches per rank at 4 ranks: 24 consumed
    accumulate, message = continue_at_world_size(shrunk, saved_world_size=4, saved_accumulate=1, world_size=2)
    assert (accumulate, shrunk.batch_in_epoch) == (2, 12) and "accumulate_grad_batches 1 -> 2" in message
    grown = Position(step=4, epoch=0, batch_in_epoch=12)
    accumulate, message = continue_at_world_size(grown, saved_world_size=2, saved_accumulate=2, world_size=4)
    assert (accumulate, grown.batch_in_epoch) == (1, 6) and "accumulate_grad_batches 2 -> 1" in message
    odd = Position(
        step=4, epoch=0, batch_in_epoch=5
    )  # 10 consumed at 2 ranks; 3 ranks can't share 2 per step
    accumulate, message = continue_at_world_size(odd, saved_world_size=2, saved_accumulate=1, world_size=3)
    assert (accumulate, odd.batch_in_epoch) == (1, 3)
    assert (
        "cannot be split over 3 ranks" in message
        and "1 per-rank batch(es) of this epoch are seen again" in message
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchrun_restarts_resume_too(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """Under torchrun's own agent (its shared store keeps the failed attempt's keys), --max-restarts restarts
    the group and the Trainer resumes by itself. A launch made from this process before must not leave its
    rendezvous round behind: torchrun's restarted workers named their keys after it, as the failed ones had, and
    failed (this test passed alone and failed after any other launch in the same process)."""
    from stratagem.launchers._worker_start import launch_function

    rounds = launch_function(os.getenv, ("STRATAGEM_RENDEZVOUS_ROUND",), nproc_per_node=1)
    assert rounds == {0: "0"}, rounds
    assert "STRATAGEM_RENDEZVOUS_ROUND" not in os.environ
    root = tmp_path / "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [
        "--max-restarts",
        "1",
        str(SCRIPT),
        "--devices",
        "2",
        "--steps",
        str(STEPS),
        "--optimizer",
        "adamw",
    ]
    command += ["--shuffle", "--ckpt-every", "2", "--root", str(root), "--out", str(root / "out")]
    command += ["--faults", "0:1:3:raise"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=250)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from step 2" in done.stdout, done.stdout[-2000:]
    _assert_bit_equal(_params(root), reference)
