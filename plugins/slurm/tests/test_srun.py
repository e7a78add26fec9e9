"""The training script under a real ``srun -n 2``: each task is one worker (stratagem launches nothing), with
the compute threads the elastic launcher gives its workers, and the run ends where ``python train.py`` with
``devices=2`` ends."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from slurm_runs import relative_difference, results, run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_srun_tasks_train_as_the_elastic_launchers_workers(
    slurm, elastic_reference: list[dict], tmp_path: Path
) -> None:
    done = run_script(tmp_path, prefix=("srun", "--ntasks=2", sys.executable))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    under_srun = results(tmp_path)
    for rank, (got, want) in enumerate(zip(under_srun, elastic_reference)):
        assert got["rank"] == rank and got["world_size"] == 2 and got["step"] == 6, got
        # torch's default would be one thread per core (2 here); a worker of the elastic launcher gets 1.
        assert got["threads"] == want["threads"] == 1, (got["threads"], want["threads"])
        # It trained: six AdamW steps (an untrained run would also be far from the reference's parameters).
        assert all(int(state["step"]) == 6 for state in got["optimizer"]["state"].values())
        assert relative_difference(got["params"], want["params"]) < 1e-6
        # The same threads and the same collectives: the same bits.
        assert all(torch.equal(got["params"][k], want["params"][k]) for k in want["params"])
