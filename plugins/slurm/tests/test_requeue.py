"""Preemption under a real SLURM: ``sbatch --requeue`` of a 2-task batch script, ``scancel --batch --signal=USR1``
mid-run. The tasks save the step they reached, rank 0 requeues the job (``scontrol requeue``), and the requeued
job resumes from that checkpoint by itself (``SLURM_RESTART_COUNT`` makes it a restart) and ends bit-identical to
the uninterrupted elastic run. The ``slurm`` fixture fails the test if a job or a process is left behind."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_runs import ARGS, SCRIPT, results

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _job_field(slurm, job: str, name: str) -> str | None:
    shown = slurm.run("scontrol", "show", "job", "-o", job).stdout
    found = re.search(rf"\b{name}=(\S+)", shown)
    return found.group(1) if found else None


def test_a_requeued_job_resumes_from_its_preemption_checkpoint_bit_for_bit(
    slurm, elastic_reference: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = tmp_path / "progress"
    progress.mkdir()
    monkeypatch.setenv("SG_PROGRESS_DIR", str(progress))  # sbatch hands this environment to the job
    runs, out = tmp_path / "runs", tmp_path / "out"
    train = [
        sys.executable,
        str(SCRIPT),
        *ARGS,
        "--root",
        str(runs),
        "--out",
        str(out),
        "--step-sleep",
        "0.4",
    ]
    # `exec`: the batch step is srun itself, which passes the signal on to the tasks (a shell would die of it).
    (tmp_path / "job.sh").write_text("#!/bin/bash\nexec srun " + " ".join(train) + "\n")
    submitted = slurm.run(
        "sbatch", "--parsable", "--requeue", "--ntasks=2", "--open-mode=append", f"--chdir={tmp_path}",
        f"--output={tmp_path / 'job.out'}", str(tmp_path / "job.sh"),
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 90
    # The signal comes during the second step: the exchange of its boundary carries it and the ranks stop after
    # the third (the fourth when the signal reached the tasks after that exchange had started; a fifth leaves
    # a margin). Stopping after the second would mean a rank acted on its own signal, without the others.
    while not (progress / "rank0").is_file() or int((progress / "rank0").read_text().split()[0]) < 1:
        assert time.monotonic() < deadline, [*slurm.jobs(), (tmp_path / "job.out").read_text()[-3000:]]
        time.sleep(0.05)
    signalled = slurm.run("scancel", "--batch", "--signal=USR1", job)
    assert signalled.returncode == 0, signalled.stderr
    assert slurm.wait_for_empty_queue(timeout=120) == [], (tmp_path / "job.out").read_text()[-4000:]
    log = (tmp_path / "job.out").read_text()
    assert _job_field(slurm, job, "JobState") == "COMPLETED" and _job_field(slurm, job, "Restarts") == "1", (
        log
    )
    stopped = re.search(r"preempted by SIGUSR1 at step (\d+): saved (\S+) ", log)
    assert stopped, log[-4000:]
    step = int(stopped.group(1))
    assert 3 <= step < 6 and stopped.group(2).endswith(f"step-{step:06d}.ckpt")
    assert f"requeued SLURM job {job}: it resumes from this checkpoint" in log
    # The requeued job restarted the script, which resumed by itself: a restart caused by the preemption.
    assert (
        f"restart 1: preempted by SIGUSR1 at step {step} (SLURM requeued the job); resumed from step {step}; "
        "0 step(s) lost"
    ) in log, log[-4000:]
    for rank, (got, want) in enumerate(zip(results(tmp_path), elastic_reference)):
        assert got["rank"] == rank and got["step"] == 6 and got["threads"] == want["threads"]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), (rank, name)
    # SLURM_RESTART_COUNT shows in the restarts metric of the requeued run's rows.
    rows = (runs / "run0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    restarts = [row.split(",")[header.index("restarts")] for row in rows[1:] if int(row.split(",")[0]) > step]
    assert restarts and set(restarts) == {"1.0"}, rows
    assert not os.environ.get("SLURM_JOB_ID")  # the test itself ran outside any job
