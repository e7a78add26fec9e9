"""Bad input to the ``slurm`` launcher fails before anything is submitted, saying what was wrong and what to do;
the launcher's options are checked when it is made (these need no cluster). The real cluster answers the
questions about partitions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import stratagem as sg
from stratagem.errors import ConfigurationError
from stratagem.launchers import LaunchJob
from stratagem_slurm import SlurmLauncher
from stratagem_slurm._task import tasks_on_node

SCRIPT = Path(__file__).resolve().parents[3] / "core" / "tests" / "workloads" / "sg_workloads.py"


def _job(devices: int = 2, nnodes: int | str = 1) -> LaunchJob:
    return LaunchJob(
        kind="script", command=(sys.executable, "train.py"), nproc_per_node=devices, nnodes=nnodes
    )


def _launch(launcher: SlurmLauncher, job: LaunchJob) -> None:
    launcher.launch_workers(job)


def _refused(slurm, folder: Path, launcher: SlurmLauncher, job: LaunchJob, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        _launch(launcher, job)
    assert message in str(caught.value), str(caught.value)
    assert slurm.jobs() == [] and not folder.exists(), "something was submitted"


def test_an_unknown_partition_or_more_tasks_than_it_has(slurm, tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    cpus = slurm.cpus
    _refused(
        slurm,
        folder,
        SlurmLauncher(partition="debgu", folder=folder),
        _job(),
        "Unknown SLURM partition 'debgu'. Did you mean 'debug'? Partitions of this cluster: debug.",
    )
    _refused(
        slurm,
        folder,
        SlurmLauncher(folder=folder),
        _job(devices=cpus + 1),
        f"1 node(s) x {cpus + 1} task(s) x 1 CPU(s) per task need {cpus + 1} CPUs on each of 1 node(s); "
        f"partition 'debug' has 1 node(s) with {cpus} CPUs, 0 of them large enough.",
    )
    _refused(
        slurm,
        folder,
        SlurmLauncher(folder=folder, cpus_per_task=2),
        _job(devices=cpus),
        f"need {2 * cpus} CPUs on each of 1 node(s)",
    )
    _refused(slurm, folder, SlurmLauncher(folder=folder), _job(devices=1, nnodes=2), "1 of them large enough")
    _refused(slurm, folder, SlurmLauncher(folder=folder), _job(nnodes="1:2"), "a fixed number of nodes")


def test_stratagem_run_asks_slurm_for_the_nodes(slurm, tmp_path: Path) -> None:
    """`stratagem run --launcher slurm --nnodes 2` needs no rendezvous endpoint (one job starts every node);
    the one-node test partition refuses the request before anything is submitted."""
    command = [sys.executable, "-m", "stratagem", "run", "--launcher", "slurm", "--nnodes", "2", str(SCRIPT)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert (
        "2 node(s) x 1 task(s) x 1 CPU(s) per task need 1 CPUs on each of 2 node(s); partition 'debug' has 1 node(s)"
        in done.stderr
    ), done.stderr
    assert slurm.jobs() == [] and not (tmp_path / "stratagem-slurm").exists()


def test_no_slurm_reachable_says_what_to_install_or_set(slurm, tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "jobs"
    dead = tmp_path / "dead.conf"
    # The cluster's configuration with a controller port where nothing listens.
    lines = [
        "SlurmctldPort=9" if line.startswith("SlurmctldPort=") else line
        for line in slurm.conf.read_text().splitlines()
    ]
    dead.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("SLURM_CONF", str(dead))
    _refused(slurm, folder, SlurmLauncher(folder=folder), _job(), "no SLURM controller answers")
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("PATH", str(tmp_path))  # no client commands
    with pytest.raises(ConfigurationError) as caught:
        _launch(SlurmLauncher(folder=folder), _job())
    assert "SLURM's client commands on PATH; sbatch, squeue, scontrol, scancel, sinfo not found" in str(
        caught.value
    )
    assert "apt-get install slurm-client munge" in str(caught.value) and "SLURM_CONF" in str(caught.value)


def test_options_are_checked_when_the_launcher_is_made() -> None:
    with pytest.raises(ConfigurationError, match=r"cpus_per_task=0\): give a positive whole number"):
        SlurmLauncher(cpus_per_task=0)
    with pytest.raises(ConfigurationError, match=r"time='an hour'\): give minutes or"):
        SlurmLauncher(time="an hour")
    with pytest.raises(ConfigurationError, match=r"launcher_options for launcher 'slurm': .*'partiton'"):
        sg.Engine(
            strategy="ddp", accelerator="cpu", devices=2, launcher="slurm", launcher_options={"partiton": "x"}
        )
    made = SlurmLauncher(cpus_per_task="2", time=30, account="ml", sbatch_args="--exclusive --comment 'a b'")
    assert made.cpus_per_task == 2 and made.time == "30"
    assert made.sbatch_args == ("--account=ml", "--exclusive", "--comment", "a b")


def test_tasks_per_node_in_slurms_notation() -> None:
    assert [tasks_on_node("2(x3),1", node) for node in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("4", 0) == 4
