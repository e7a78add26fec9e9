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


#: torch's c10d rendezvous: a node that stops sending keep-alives is dropped after interval x attempts (5 s x 3
#: by default); 1 s x 3 here, so the survivor re-forms the group sooner.
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_lost_node_leaves_the_other_to_finish_at_the_smaller_world_size(tmp_path: Path) -> None:
    """Two elastic agents ("nodes" of one worker each, c10d rendezvous on localhost, --nnodes 1:2): the second
    agent's whole process tree is killed; the first re-forms the group alone and resumes from the newest
    sharded checkpoint, resharded from 2 ranks to 1, keeping the global batch by accumulation."""
    import time

    from stratagem.launchers._worker_start import free_port

    root, port = tmp_path / "elastic", free_port()
    steps = 14
    run = [
        sys.executable,
        "-m",
        "stratagem",
        "run",
        "--nnodes",
        "1:2",
        "--devices",
        "1",
        "--max-restarts",
        "2",
    ]
    run += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", RDZV_CONF, str(SCRIPT)]
    run += [
        "--strategy",
        "fsdp",
        "--devices",
        "1",
        "--steps",
        str(steps),
        "--batch",
        "4",
        "--ckpt-every",
        "2",
    ]
    run += ["--format", "sharded", "--step-sleep", "0.4", "--root", str(root), "--out", str(root / "out")]
    with open(tmp_path / "node0.log", "w") as log0, open(tmp_path / "node1.log", "w") as log1:
        survivor = subprocess.Popen(run, stdout=log0, stderr=subprocess.STDOUT, start_new_session=True)
        time.sleep(1.0)  # the survivor binds the rendezvous endpoint: the node that hosts it must stay
        lost = subprocess.Popen(run, stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
    checkpoints = root / "run0" / "checkpoints"
    try:
        deadline = time.monotonic() + 120
        while not (checkpoints / "step-000004").is_dir():
            assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()[-3000:]
            assert survivor.poll() is None and lost.poll() is None
            time.sleep(0.2)
        _kill_tree(lost.pid)
        assert survivor.wait(timeout=200) == 0, (tmp_path / "node0.log").read_text()[-4000:]
    finally:
        for process in (survivor, lost):
            if process.poll() is None:
                _kill_tree(process.pid)
                process.wait()
    log = (tmp_path / "node0.log").read_text()
    assert "world size changed from 2 to 1" in log and "accumulate_grad_batches 1 -> 2" in log, log[-4000:]
    (result,) = torch.load(f"{root / 'out'}.rank0", weights_only=False)
    assert result["world_size"] == 1 and result["step"] == steps
    assert all(torch.isfinite(p).all() for p in result["params"].values())
    time.sleep(0.5)
    sys.path.insert(0, str(WORKLOADS))
    import sg_workloads as wl

    assert wl.processes_mentioning(str(root)) == []


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (the agent starts each worker in a session of its own)."""
    import os
    import signal

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
