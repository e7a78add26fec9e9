"""The SLURM tests share one real cluster per test session (:mod:`slurm_cluster`) and one elastic run of the
training script to compare with. Where SLURM is not installed they skip, saying what to install."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import slurm_cluster  # noqa: E402
from slurm_runs import results, run_script  # noqa: E402


@pytest.fixture(scope="session")
def slurm_session(tmp_path_factory: pytest.TempPathFactory) -> slurm_cluster.Cluster:
    reason = slurm_cluster.why_unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"), os.cpu_count() or 2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_session: slurm_cluster.Cluster, monkeypatch: pytest.MonkeyPatch) -> slurm_cluster.Cluster:
    """The session's cluster for one test (its clients find it through ``SLURM_CONF``). After the test no job
    may be in its queue and no process of its jobs alive: what is left is cleared, and the test fails."""
    cluster = slurm_session
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    yield cluster
    jobs = cluster.wait_for_empty_queue()
    processes = cluster.wait_for_job_processes()
    if jobs:
        cluster.run("scancel", "--full", f"--user={os.getuid()}")
        cluster.wait_for_empty_queue()
    for line in processes:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if jobs or processes:
        pytest.fail(f"left behind: jobs {jobs}, processes {processes}")


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The script under stratagem's default launcher (torch's elastic agent), devices=2: what SLURM must match."""
    root = tmp_path_factory.mktemp("elastic")
    done = run_script(root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return results(root)
