"""The ``slurm`` launcher against the real test cluster: the script submitted from outside any allocation ends
where the elastic run ends, a function returns rank 0's result (the launcher contract), a failing rank is
named, a restart resumes bit for bit, Ctrl-C cancels the job, and bad input fails before anything is
submitted. The ``slurm`` fixture fails a test that leaves a job in the queue or a process behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from slurm_runs import SCRIPT, relative_difference, results, run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _same(got: list[dict], want: list[dict]) -> None:
    for rank, (mine, theirs) in enumerate(zip(got, want)):
        assert mine["rank"] == rank and mine["world_size"] == 2 and mine["step"] == 6, mine
        assert mine["threads"] == theirs["threads"], (mine["threads"], theirs["threads"])
        assert all(int(state["step"]) == 6 for state in mine["optimizer"]["state"].values())
        assert relative_difference(mine["params"], theirs["params"]) < 1e-6
        assert all(torch.equal(mine["params"][k], theirs["params"][k]) for k in theirs["params"])


@pytest.mark.parametrize("how", ["Trainer(launcher='slurm')", "stratagem run --launcher slurm"])
def test_the_script_submitted_from_outside_matches_the_elastic_run(
    slurm, elastic_reference: list[dict], tmp_path: Path, how: str
) -> None:
    if how.startswith("Trainer"):
        done = run_script(tmp_path, "--launcher", "slurm", "--launcher-options", "partition=debug,time=5")
    else:  # options through sbatch's own environment variables
        prefix = (sys.executable, "-m", "stratagem", "run", "--launcher", "slurm", "--devices", "2")
        done = run_script(tmp_path, prefix=prefix, env={"SBATCH_PARTITION": "debug", "SBATCH_TIMELIMIT": "5"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "stratagem: submitted SLURM job" in done.stderr and "partition debug" in done.stderr
    # Rank 0's output reached the submitting process (the progress bar's last line).
    assert "train step 6/6" in done.stdout, done.stdout[-2000:]
    _same(results(tmp_path), elastic_reference)
    (job_dir,) = (tmp_path / "stratagem-slurm").iterdir()
    assert sorted(p.name for p in (job_dir / "attempt-0").glob("rank-*.out")) == ["rank-0.out", "rank-1.out"]


def test_the_launcher_contract_certifies_slurm(slurm, tmp_path: Path) -> None:
    """A function job returns rank 0's result, a raising rank is named with its traceback, a script job gets
    the rank environment: the contract suite's launcher section, as ``stratagem contract --launcher slurm``."""
    junit = tmp_path / "report.xml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratagem",
            "contract",
            "--launcher",
            "slurm",
            f"--pytest-args=--junitxml={junit}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    cases = {case.get("name") for case in ET.parse(junit).getroot().iter("testcase")}
    assert "test_function_job_gets_rank_environment_and_a_working_group[slurm]" in cases, cases
    assert "test_worker_exception_names_its_rank_and_does_not_hang[slurm]" in cases, cases


FUNCTIONS = """
import stratagem as sg


def total(engine, base):
    import torch

    return {"rank": engine.rank, "sum": engine.all_reduce(torch.tensor([engine.rank + 1.0]), "sum").item() + base}


if __name__ == "__main__":
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2, launcher="slurm")
    print("RESULTS", engine.launch(total, 10), engine.launch(lambda e: e.world_size * 100))
"""


def test_functions_of_a_script_return_rank_0s_result(slurm, tmp_path: Path) -> None:
    """Engine.launch(fn) from a script: a function of the script itself (unpickled in the tasks as under the
    elastic launcher, from the script imported as __mp_main__), then a lambda (the tasks re-run the script)."""
    script = tmp_path / "functions.py"
    script.write_text(FUNCTIONS)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # 10 + (1 + 2): rank 0's result of an all_reduce over both tasks; 100 x a world of 2.
    assert done.stdout.strip() == "RESULTS {'rank': 0, 'sum': 13.0} 200", done.stdout
    names = sorted(p.name.rsplit("-", 3)[0] for p in (tmp_path / "stratagem-slurm").iterdir())
    assert names == ["stratagem-functions", "stratagem-functions"], names


def test_a_failing_rank_is_named(slurm, tmp_path: Path) -> None:
    raised = run_script(tmp_path / "raise", "--launcher", "slurm", "--fail", "raise", "--fail-rank", "1")
    assert raised.returncode != 0
    assert "stratagem: Training failed: rank 1 exited with code 1." in raised.stderr, raised.stderr[-3000:]
    assert "RuntimeError: deliberate failure on rank 1" in raised.stderr, raised.stderr[-3000:]
    killed = run_script(tmp_path / "kill", "--launcher", "slurm", "--fail", "kill", "--fail-rank", "0")
    assert killed.returncode != 0
    assert "rank 0 exited with code -9.\nkilled by signal SIGKILL" in killed.stderr, killed.stderr[-3000:]


def test_a_restart_resumes_bit_for_bit(slurm, elastic_reference: list[dict], tmp_path: Path) -> None:
    """max_restarts=1: rank 1 dies at step 3 of the first attempt; the batch job runs the step again, and the
    Trainer resumes from the step-2 checkpoint."""
    done = run_script(
        tmp_path, "--launcher", "slurm", "--max-restarts", "1", "--ckpt-every", "2", "--faults", "0:1:3:kill"
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (job_dir,) = (tmp_path / "stratagem-slurm").iterdir()
    assert sorted(p.name for p in job_dir.glob("attempt-*")) == ["attempt-0", "attempt-1"]
    _same(results(tmp_path), elastic_reference)


def _reader(stream, lines: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True)
    thread.start()
    return thread


def test_ctrl_c_cancels_the_job(slurm, tmp_path: Path) -> None:
    root = tmp_path
    command = [sys.executable, str(SCRIPT), "--devices", "2", "--steps", "200", "--step-sleep", "0.2"]
    command += ["--launcher", "slurm", "--root", str(root / "runs"), "--out", str(root / "out")]
    launcher = subprocess.Popen(
        command,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a suite started in the background by a shell inherits SIGINT
        # ignored, and Python then leaves it ignored in the launching process.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out: list[str] = []
    err: list[str] = []
    readers = [_reader(launcher.stdout, out), _reader(launcher.stderr, err)]
    deadline = time.monotonic() + 90
    # Rank 0's progress lines arrive while the job runs.
    while not any("train step" in line for line in out) and time.monotonic() < deadline:
        assert launcher.poll() is None, "".join(err)[-3000:]
        time.sleep(0.2)
    assert any("train step" in line for line in out), "".join(out + err)[-3000:]
    assert slurm.jobs(), "the job is not in the queue while it trains"
    launcher.send_signal(signal.SIGINT)
    launcher.wait(timeout=60)
    for reader in readers:
        reader.join(timeout=10)
    assert launcher.returncode != 0
    assert any("stratagem: cancelling SLURM job" in line for line in err), "".join(err)[-3000:]
    # The launcher returned once the job had left the queue.
    assert slurm.jobs() == []
    assert not (root / "out.rank0").exists()
