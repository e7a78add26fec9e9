"""Runs across hosts (stratagem.contract.hosts: network namespaces with host names of their own, one shared
folder): the elastic launcher and torchrun, one launcher per host with the rendezvous on h0, train the demo's
model as the same four processes do on one host."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stratagem.contract.hosts import Host, Hosts

SCRIPT = str(Path(__file__).resolve().parent / "many_hosts_train.py")
STEPS = 6
#: One run of the launchers on both hosts, start-up included, on a busy 2-core machine.
RUN_TIMEOUT = 240
#: Each test makes up to two runs of 4 workers (torch imported 6 times each).
pytestmark = [pytest.mark.multiprocess, pytest.mark.cluster, pytest.mark.timeout(2 * RUN_TIMEOUT + 60)]


def _train(
    hosts: Hosts, name: str, launchers: list[tuple[Host, list[str]]], devices: int, nodes: int
) -> dict:
    root = hosts.shared / name
    out = root / "out.pt"
    script = [SCRIPT, "--devices", str(devices), "--num-nodes", str(nodes), "--steps", str(STEPS)]
    script += ["--root", str(root), "--out", str(out)]
    done = hosts.run_together(
        [(host, [*launcher, *script]) for host, launcher in launchers], timeout=RUN_TIMEOUT
    )
    for (host, _), result in zip(launchers, done):
        assert result.returncode == 0, f"{name} on {host.name}:\n{result.stdout[-4000:]}"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_host(make_hosts: Any) -> dict:
    """The reference: the same world, four processes, on one host."""
    hosts = make_hosts(2)
    run = [sys.executable, "-m", "stratagem", "run", "--devices", "4"]
    result = _train(hosts, "one-host", [(hosts[0], run)], devices=4, nodes=1)
    assert hosts.left_behind() == {}
    return result


def _assert_trained_alike(
    got: dict,
    want: dict,
    tolerance: float = 1e-6,
    world_size: int = 4,
    steps: int = STEPS,
    margin: float = 1000,
) -> None:
    assert got["world_size"] == want["world_size"] == world_size and got["step"] == want["step"] == steps
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["start"].items():
        assert torch.equal(got["start"][name], value), f"{name}: the runs started apart"
    difference = max((got["params"][k] - v).abs().max().item() for k, v in want["params"].items())
    moved = max((v - want["start"][k]).abs().max().item() for k, v in want["params"].items())
    print(
        f"largest difference {difference:.3g} from the reference; training moved a parameter by {moved:.3g}"
    )
    # A run that never trained would be `moved` away: `margin` times the tolerance.
    assert moved > margin * tolerance
    assert difference <= tolerance, f"largest difference {difference:.3g} (moved {moved:.3g})"


def test_the_elastic_launcher_on_two_hosts_trains_as_four_processes_on_one(
    stratagem_hosts: Hosts, one_host: dict
) -> None:
    h0, h1 = stratagem_hosts
    run = [sys.executable, "-m", "stratagem", "run", "--nnodes", "2", "--devices", "2"]
    run += ["--rdzv-endpoint", "h0:29400"]
    got = _train(stratagem_hosts, "elastic", [(h0, run), (h1, run)], devices=2, nodes=2)
    _assert_trained_alike(got, one_host)


def test_torchrun_on_two_hosts_trains_as_four_processes_on_one(
    stratagem_hosts: Hosts, one_host: dict
) -> None:
    h0, h1 = stratagem_hosts
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    run += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29401", "--rdzv-id", "many-hosts"]
    got = _train(stratagem_hosts, "torchrun", [(h0, run), (h1, run)], devices=2, nodes=2)
    _assert_trained_alike(got, one_host)


#: The Trainer's timeout in the cut-off run: the survivors must notice within it, and have finished without the
#: lost host within twice it.
TIMEOUT = 30
CUT_STEPS = 12
#: The step after which the link goes down: late, so that what is left after the cut is the recovery (noticing,
#: the new rendezvous, new workers, the resume) and two or three steps, not most of the training.
CUT_AFTER = 9


def _wait_for_step(mark: Path, step: int, processes: list[Any], deadline: float) -> None:
    while not (mark.is_file() and mark.read_text().strip() and int(mark.read_text()) >= step):
        assert all(p.poll() is None for p in processes), "a launcher ended before the cut"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.1)


def _wait_all(processes: list[Any], deadline: float) -> list[float]:
    """When each process ended (wall clock); kills every one still running at the deadline."""
    ended: dict[int, float] = {}
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for i, p in enumerate(processes):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.1)
    for p in processes:
        if p.poll() is None:
            p.kill()
    return [ended.get(i, float("inf")) for i in range(len(processes))]


def test_a_host_cut_off_mid_run_is_left_out_and_the_other_finishes_alone(stratagem_hosts: Hosts) -> None:
    """Two hosts of one worker each (--nnodes 1:2, c10d rendezvous on h0, sharded checkpoints every step); h1's
    link goes down after step 9 of 12. h0 names the lost host within the timeout, its next rendezvous leaves h1
    out, and it has finished alone within twice the timeout of the cut, from the newest complete checkpoint, as a
    one-process run resumed from that checkpoint does. h1's launcher, which can no longer reach the rendezvous,
    ends by itself."""
    h0, h1 = stratagem_hosts
    root = stratagem_hosts.shared / "cut"
    root.mkdir()
    mark, starts, out = root / "step", root / "starts", root / "out.pt"
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
    run += ["--rdzv-endpoint", "h0:29403", "--rdzv-conf", "last_call_timeout=2"]
    script = [SCRIPT, "--strategy", "fsdp", "--devices", "1", "--steps", str(CUT_STEPS), "--ckpt-every", "1"]
    script += [
        "--format",
        "sharded",
        "--timeout",
        str(TIMEOUT),
        "--step-sleep",
        "0.3",
        "--root",
        str(root / "run"),
    ]
    script += ["--out", str(out), "--mark", str(mark), "--starts", str(starts)]
    logs = [root / "h0.log", root / "h1.log"]
    processes = _launch([h0, h1], run, script, logs)
    try:
        _wait_for_step(mark, CUT_AFTER, processes, time.monotonic() + RUN_TIMEOUT)
        cut = time.time()
        h1.cut()
        ended = _wait_all(processes, time.monotonic() + RUN_TIMEOUT)
    finally:
        h1.reconnect()
    survivor, lost = (log.read_text() for log in logs)
    assert processes[0].returncode == 0, survivor[-4000:]
    # The cut-off host's launcher ends by itself, naming what it lost, once the others have dropped it.
    assert processes[1].returncode == 1 and "cannot reach the rendezvous at h0:29403" in lost, lost[-3000:]
    assert ended[1] - cut <= 2 * TIMEOUT, f"h1 ended {ended[1] - cut:.1f} s after the cut"
    # The survivor names the lost host and restarts without it, at the smaller world size.
    noticed = re.search(
        r"rank 0 waited ([\d.]+) s \(timeout \d+ s\) for rank 1 \(on h1\), which did not arrive", survivor
    )
    assert noticed is not None, survivor[-3000:]
    # The watchdog looks once a second: it speaks within a second of the timeout (two on a busy machine).
    assert float(noticed.group(1)) <= TIMEOUT + 2
    assert (
        "restarting the workers (1 of 2 restarts)" in survivor
        and "world size changed from 2 to 1" in survivor
    )
    restarted = [
        float(t) for t, host in (line.split() for line in starts.read_text().splitlines()) if float(t) > cut
    ]
    assert restarted and min(restarted) - cut <= 2 * TIMEOUT, (
        f"new workers {min(restarted) - cut:.1f} s after the cut"
    )
    print(
        f"after the cut: h1's launcher ended at {ended[1] - cut:.1f} s, h0's new workers started at "
        f"{min(restarted) - cut:.1f} s, h0 finished at {ended[0] - cut:.1f} s"
    )
    assert ended[0] - cut <= 2 * TIMEOUT, f"h0 finished {ended[0] - cut:.1f} s after the cut"
    got = torch.load(out, weights_only=False)
    assert got["world_size"] == 1 and got["step"] == CUT_STEPS
    # The same run resumed the same way: one process from the checkpoint the survivor resumed from.
    checkpoint = re.search(r"Resumed from (\S+) at step (\d+)", survivor)
    assert checkpoint is not None and int(checkpoint.group(2)) >= CUT_AFTER - 1, survivor[-3000:]
    reference = root / "reference.pt"
    again = [sys.executable, SCRIPT, "--strategy", "fsdp", "--devices", "1", "--steps", str(CUT_STEPS)]
    again += ["--ckpt-path", checkpoint.group(1), "--root", str(root / "reference"), "--out", str(reference)]
    done = h0.run(again, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    want = torch.load(reference, weights_only=False)
    # Resumed at step 8 or 9, the last steps of the decaying schedule move a parameter by about 3e-3 (measured):
    # a hundred times the tolerance, not a thousand.
    _assert_trained_alike(got, want, tolerance=1e-5, world_size=1, steps=CUT_STEPS, margin=100)


def _launch(hosts: list[Host], run: list[str], script: list[str], logs: list[Path]) -> list[subprocess.Popen]:
    processes = []
    for host, log in zip(hosts, logs):
        with open(log, "w") as file:
            processes.append(host.popen([*run, *script], stdout=file, stderr=subprocess.STDOUT))
    return processes


def test_without_elasticity_a_host_cut_off_ends_the_run_naming_it(stratagem_hosts: Hosts) -> None:
    """A fixed two-node run without restarts: h1's link goes down after step 2; h0's launcher ends the run within
    twice the timeout, naming rank 1 and its host, and h1's launcher ends by itself."""
    h0, h1 = stratagem_hosts
    root = stratagem_hosts.shared / "fixed"
    root.mkdir()
    mark, logs = root / "step", [root / "h0.log", root / "h1.log"]
    run = [sys.executable, "-m", "stratagem", "run", "--nnodes", "2", "--devices", "1"]
    run += ["--rdzv-endpoint", "h0:29404"]
    script = [SCRIPT, "--devices", "1", "--num-nodes", "2", "--steps", "40", "--timeout", str(TIMEOUT)]
    script += [
        "--step-sleep",
        "0.3",
        "--root",
        str(root / "run"),
        "--out",
        str(root / "out.pt"),
        "--mark",
        str(mark),
    ]
    processes = _launch([h0, h1], run, script, logs)
    try:
        _wait_for_step(mark, 2, processes, time.monotonic() + RUN_TIMEOUT)
        cut = time.time()
        h1.cut()
        ended = _wait_all(processes, time.monotonic() + RUN_TIMEOUT)
    finally:
        h1.reconnect()
    survivor, lost = (log.read_text() for log in logs)
    print(f"after the cut: h0's launcher ended at {ended[0] - cut:.1f} s, h1's at {ended[1] - cut:.1f} s")
    assert processes[0].returncode not in (0, None) and "for rank 1 (on h1), which did not arrive" in survivor
    assert ended[0] - cut <= 2 * TIMEOUT, survivor[-3000:]
    assert processes[1].returncode == 1 and "cannot reach the rendezvous at h0:29404" in lost, lost[-3000:]
    assert ended[1] - cut <= 2 * TIMEOUT
    assert not (root / "out.pt").exists()


def test_a_host_that_joins_late_is_taken_in(stratagem_hosts: Hosts) -> None:
    """--nnodes 1:2: h0 starts alone and trains; h1 starts later, joins the next round of the rendezvous, and both
    finish at world size 2 (a node new to a later round found no store address there before stratagem wrote it
    in every round: DistStoreError after 60 s)."""
    h0, h1 = stratagem_hosts
    root = stratagem_hosts.shared / "late"
    root.mkdir()
    mark, logs = root / "step", [root / "h0.log", root / "h1.log"]
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
        "1",
    ]
    run += ["--rdzv-endpoint", "h0:29405", "--rdzv-conf", "last_call_timeout=1"]
    script = [SCRIPT, "--strategy", "fsdp", "--devices", "1", "--steps", "30", "--ckpt-every", "1"]
    script += ["--format", "sharded", "--step-sleep", "0.3", "--root", str(root / "run"), "--mark", str(mark)]
    script += ["--out", str(root / "out.pt")]
    first = _launch([h0], run, script, logs[:1])
    _wait_for_step(mark, 2, first, time.monotonic() + RUN_TIMEOUT)
    processes = first + _launch([h1], run, script, logs[1:])
    _wait_all(processes, time.monotonic() + RUN_TIMEOUT)
    texts = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0], "\n".join(t[-3000:] for t in texts)
    assert "world size changed from 1 to 2" in texts[0], texts[0][-3000:]
    got = torch.load(root / "out.pt", weights_only=False)
    assert got["world_size"] == 2 and got["step"] == 30
