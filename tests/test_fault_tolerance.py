"""SIGKILL at random (rank, step) pairs under ddp and fsdp: with restarts, the run finishes with the parameters
of an uninterrupted run, bit for bit. One launch absorbs several kills (one per restart attempt)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKLOADS = Path(__file__).resolve().parents[1] / "core" / "tests" / "workloads"
SCRIPT = WORKLOADS / "sg_workloads.py"
STEPS = 9
KILLS = 3


def _run(root: Path, strategy: str, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", "2", "--steps", str(STEPS)]
    command += ["--optimizer", "adamw", "--shuffle", "--ckpt-every", "2", "--root", str(root)]
    command += ["--out", str(root / "out"), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=280)


def _kill_schedule(seed: int) -> list[tuple[int, int, int]]:
    """(attempt, rank, step): each attempt dies at a random step of its own, after the step it resumed from."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, STEPS), KILLS))
    return [(attempt, rng.randrange(2), step) for attempt, step in enumerate(steps)]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_random_kills_end_with_the_uninterrupted_parameters(tmp_path: Path, strategy: str) -> None:
    seed = random.SystemRandom().randrange(10**6)
    schedule = _kill_schedule(seed)
    faults = ",".join(f"{attempt}:{rank}:{step}:kill" for attempt, rank, step in schedule)
    reference = _run(tmp_path / "reference", strategy)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = _run(tmp_path / "killed", strategy, "--max-restarts", str(KILLS), "--faults", faults)
    assert killed.returncode == 0, f"seed {seed}, kills {schedule}:\n{killed.stderr[-3000:]}"
    for attempt, rank, _ in schedule:
        assert f"rank {rank} killed by signal SIGKILL; restarting the workers ({attempt + 1} of {KILLS}" in (
            killed.stderr
        ), f"seed {seed}: {killed.stderr[-3000:]}"
    assert f"this run was restarted {KILLS} time(s)" in killed.stdout
    (want,) = torch.load(f"{tmp_path / 'reference' / 'out'}.rank0", weights_only=False)
    (got,) = torch.load(f"{tmp_path / 'killed' / 'out'}.rank0", weights_only=False)
    assert got["step"] == want["step"] == STEPS
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), f"seed {seed}, kills {schedule}: {name} differs"
