"""SLURM with two nodes, each a host of its own (:mod:`stratagem.contract.hosts`): ``slurmctld`` on ``h0``, a
``slurmd`` on each host under the host's name and address, the client commands on ``h0`` (the login node).
``srun -N2 -n4`` of the training script and ``launcher="slurm"`` with ``num_nodes=2`` train as the elastic
launcher's four processes do; a requeued job resumes bit for bit on both nodes; a node cut off mid-job ends
the job, naming the node.

One set of hosts and one cluster serve the module (the cluster starts in about a second; the workers are what
takes time). After each test no job is queued, no job's process is alive, both nodes are back in service, and
no host's temporary folder holds a stratagem entry.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import slurm_cluster
import torch
from slurm_runs import ARGS, SCRIPT, relative_difference

pytestmark = [pytest.mark.multiprocess, pytest.mark.cluster, pytest.mark.timeout(300)]
#: One launch of four workers, start-up included, on a busy 2-core machine.
RUN_TIMEOUT = 240
TWO_NODES = ("--devices", "2", "--num-nodes", "2")


@pytest.fixture(scope="module")
def cluster(make_hosts: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    reason = slurm_cluster.why_unavailable()
    if reason is not None:
        pytest.skip(reason)
    hosts = make_hosts(2)
    # Two CPUs a node: two tasks on each.
    made = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm-nodes"), 2, hosts)
    try:
        made.start()
        yield made
    finally:
        made.stop()


@pytest.fixture
def nodes(cluster: Any, stratagem_hosts: Any) -> Any:
    """The module's cluster for one test; what the test left (a job, a job's process, a node out of service)
    is cleared, and fails it."""
    yield cluster
    jobs = cluster.wait_for_empty_queue(timeout=60)
    processes = cluster.wait_for_job_processes(timeout=30)
    if jobs:
        cluster.run("scancel", "--full", "--user=0")
        cluster.wait_for_empty_queue()
    for line in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (states := cluster.states()) != {"h0": "idle", "h1": "idle"} and time.monotonic() < deadline:
        time.sleep(0.5)
    # The hosts' own check follows: no process but the daemons, no stratagem scratch in their local folders.
    assert not (jobs or processes) and states == {"h0": "idle", "h1": "idle"}, (
        f"left behind: jobs {jobs}, processes {processes}, nodes {states}"
    )


def _train(
    cluster: Any, root: Path, *extra: str, prefix: tuple[str, ...] = (), env: dict | None = None
) -> str:
    """The workload script (``ARGS`` plus ``extra``) on h0, after ``prefix`` (``srun ...``); its output."""
    root.mkdir(parents=True, exist_ok=True)
    argv = [
        *prefix,
        sys.executable,
        str(SCRIPT),
        *ARGS,
        "--root",
        str(root / "runs"),
        "--out",
        str(root / "out"),
    ]
    done = cluster.hosts[0].run(
        [*argv, *extra], timeout=RUN_TIMEOUT, cwd=root, env={**cluster.env, **(env or {})}
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


def _results(root: Path, ranks: int = 4) -> list[dict]:
    return [torch.load(root / f"out.rank{rank}", weights_only=False)[0] for rank in range(ranks)]


@pytest.fixture(scope="module")
def elastic_four(cluster: Any) -> list[dict]:
    """The reference: the elastic launcher's four processes on h0 (the same world of 4 ranks)."""
    root = cluster.hosts[0].shared / "elastic-four"
    _train(cluster, root, "--devices", "4")
    return _results(root)


def _assert_as_elastic(got: list[dict], want: list[dict], exact: bool = False) -> None:
    per_node = len(want) // 2
    for rank, (mine, theirs) in enumerate(zip(got, want)):
        assert mine["rank"] == rank and mine["world_size"] == len(want) and mine["step"] == 6, mine
        # The first node's ranks, then the second's, as sbatch/srun's block distribution puts them.
        assert mine["host"] == f"h{rank // per_node}", [r["host"] for r in got]
        assert all(int(state["step"]) == 6 for state in mine["optimizer"]["state"].values())
        difference = relative_difference(mine["params"], theirs["params"])
        # Six AdamW steps of lr 1e-2 move the parameters far more than 1e-6 (relative): an untrained run fails.
        assert difference < 1e-6, f"rank {rank}: relative difference {difference:.3g}"
        if exact:
            assert all(torch.equal(mine["params"][k], theirs["params"][k]) for k in theirs["params"]), rank
    print(
        f"largest relative difference {max(relative_difference(g['params'], w['params']) for g, w in zip(got, want)):.3g}"
    )


def test_srun_on_two_nodes_trains_as_the_elastic_launcher(nodes: Any, elastic_four: list[dict]) -> None:
    root = nodes.hosts[0].shared / "srun"
    _train(nodes, root, *TWO_NODES, prefix=(nodes._commands["srun"], "-N2", "-n4"))
    _assert_as_elastic(_results(root), elastic_four)


def test_the_slurm_launcher_on_two_nodes_trains_as_the_elastic_launcher(
    nodes: Any, elastic_four: list[dict]
) -> None:
    root = nodes.hosts[0].shared / "launcher"
    output = _train(
        nodes, root, *TWO_NODES, "--launcher", "slurm", "--launcher-options", "partition=debug,time=5"
    )
    assert "2 node(s) x 2 task(s) in partition debug" in output, output[-3000:]
    _assert_as_elastic(_results(root), elastic_four)


#: The Trainer's timeout in the cut-off run (the hang watchdog's): the ranks on h0 notice within it.
TIMEOUT = 15
#: From the cut to the launcher's end: the watchdog's timeout, then srun waits for the controller to find the
#: cut-off node not responding (the test cluster's SlurmdTimeout, 10 s; SLURM's default is 300 s).
CUT_BOUND = 90


def _launch(host: Any, argv: list[str], root: Path, env: dict) -> Any:
    with open(root / "launcher.log", "w") as file:
        return host.popen(argv, cwd=root, env=env, stdout=file, stderr=file)


def _wait_for_step(progress: Path, rank: int, step: int, process: Any, log: Path) -> None:
    """Until ``rank`` notes that it begins a step after ``step`` (``SG_PROGRESS_DIR``)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    mark = progress / f"rank{rank}"
    while not (mark.is_file() and int(mark.read_text().split()[0]) >= step):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)


def test_a_node_cut_off_mid_job_ends_the_job_naming_it(nodes: Any) -> None:
    """launcher="slurm", 2 nodes x 2 tasks: h1's link goes down after step 2. The ranks on h0 name the ranks
    on h1 and their host within the timeout, the step ends, and the launcher on h0 reports the failure; SLURM
    finds h1 not responding and sets it DOWN (it returns to service once reconnected: ReturnToService=2)."""
    h0, h1 = nodes.hosts
    root = h0.shared / "cut"
    progress = root / "progress"
    progress.mkdir(parents=True)
    argv = [sys.executable, str(SCRIPT), *ARGS, *TWO_NODES, "--steps", "40", "--step-sleep", "0.3"]
    argv += ["--timeout", str(TIMEOUT), "--launcher", "slurm", "--launcher-options", "partition=debug,time=5"]
    argv += ["--root", str(root / "runs"), "--out", str(root / "out")]
    launcher = _launch(h0, argv, root, {**nodes.env, "SG_PROGRESS_DIR": str(progress)})
    log = root / "launcher.log"
    try:
        _wait_for_step(progress, 2, 2, launcher, log)
        cut = time.monotonic()
        h1.cut()
        try:
            launcher.wait(timeout=RUN_TIMEOUT)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        ended = time.monotonic() - cut
        # SLURM's own word on the node, before it is reconnected.
        deadline = time.monotonic() + 30
        while "NOT_RESPONDING" not in (shown := nodes.run("scontrol", "show", "node", "-o", "h1").stdout):
            assert time.monotonic() < deadline, shown
            time.sleep(0.5)
    finally:
        h1.reconnect()
    said = log.read_text()
    slurm_said = re.findall(r"State=\S+|Reason=.*\]", shown)
    print(f"the launcher ended {ended:.1f} s after the cut; SLURM said of h1: {slurm_said}")
    assert launcher.returncode == 1, said[-4000:]
    assert "stratagem: Training failed: rank" in said, said[-4000:]
    assert re.search(r"waited [\d.]+ s \(timeout 15 s\) for rank 2 \(on h1\), rank 3 \(on h1\)", said), said[
        -4000:
    ]
    assert ended < CUT_BOUND, said[-4000:]
    assert "State=DOWN+NOT_RESPONDING" in shown and "Reason=Not responding" in shown, shown
    assert not list(root.glob("out.rank*"))


def _job_field(cluster: Any, job: str, name: str) -> str | None:
    found = re.search(rf"\b{name}=(\S+)", cluster.run("scontrol", "show", "job", "-o", job).stdout)
    return found.group(1) if found else None


def test_a_requeued_job_resumes_bit_for_bit_on_two_nodes(nodes: Any) -> None:
    """Preemption of a batch script of one's own on both nodes (``sbatch --requeue -N2``, ``exec srun``, a task
    per node): ``scancel --batch --signal=USR1`` mid-run; the tasks save the step they reached, rank 0 requeues
    the job, and the requeued job resumes on both nodes from that checkpoint, ending as the elastic launcher's
    two processes do, bit for bit.

    One task per node: with more than two ranks DDP's resumed run is not bit-identical to an uninterrupted one,
    on one host as on several (ddp, 4 processes, resumed at step 3 of 6: 3e-8 apart). DDP lays its gradient
    buckets out anew after a process's first step, and gloo's all-reduce of four ranks sums an element in an
    order that depends on where the element lies in its bucket; a resumed run's first step is in the first
    layout, the uninterrupted run's same step in the second."""
    root = nodes.hosts[0].shared / "requeue"
    progress = root / "progress"
    progress.mkdir(parents=True)
    train = [sys.executable, str(SCRIPT), *ARGS, "--devices", "1", "--num-nodes", "2", "--step-sleep", "0.4"]
    train += ["--root", str(root / "runs"), "--out", str(root / "out")]
    # `exec`: the batch step is srun itself, which passes the signal on to the tasks (a shell would die of it).
    (root / "job.sh").write_text("#!/bin/bash\nexec srun " + " ".join(train) + "\n")
    submitted = nodes.hosts[0].run(
        [nodes._commands["sbatch"], "--parsable", "--requeue", "--nodes=2", "--ntasks-per-node=1",
         "--open-mode=append", f"--chdir={root}", f"--output={root / 'job.out'}", str(root / "job.sh")],
        timeout=30, env={**nodes.env, "SG_PROGRESS_DIR": str(progress)},
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + RUN_TIMEOUT
    # During the second step of rank 1 (on h1): the ranks stop two or three steps later (see test_requeue.py).
    while not (progress / "rank1").is_file() or int((progress / "rank1").read_text().split()[0]) < 1:
        assert time.monotonic() < deadline, [*nodes.jobs(), (root / "job.out").read_text()[-3000:]]
        time.sleep(0.05)
    signalled = nodes.run("scancel", "--batch", "--signal=USR1", job)
    assert signalled.returncode == 0, signalled.stderr
    assert nodes.wait_for_empty_queue(timeout=RUN_TIMEOUT) == [], (root / "job.out").read_text()[-4000:]
    log = (root / "job.out").read_text()
    assert _job_field(nodes, job, "JobState") == "COMPLETED" and _job_field(nodes, job, "Restarts") == "1", (
        log
    )
    assert _job_field(nodes, job, "NodeList") == "h[0-1]", log
    stopped = re.search(r"preempted by SIGUSR1 at step (\d+): saved (\S+) ", log)
    assert stopped, log[-4000:]
    step = int(stopped.group(1))
    assert 3 <= step < 6 and f"requeued SLURM job {job}: it resumes from this checkpoint" in log, log[-4000:]
    assert (
        f"restart 1: preempted by SIGUSR1 at step {step} (SLURM requeued the job); resumed from step {step}"
        in log
    )
    elastic = nodes.hosts[0].shared / "elastic-two"
    _train(nodes, elastic)  # ARGS: two processes on one host
    _assert_as_elastic(_results(root, 2), _results(elastic, 2), exact=True)
