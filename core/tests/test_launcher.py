"""Launching and failing: a worker that raises or is killed ends the whole run quickly, the failing rank and
its traceback reported once, no worker left behind and nothing in the temporary directory (nor after Ctrl-C);
bad ``stratagem run`` input fails before launching."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.launchers import _worker_start

WORKLOADS = Path(__file__).parent / "workloads"
sys.path.insert(0, str(WORKLOADS))
import sg_workloads as wl  # noqa: E402


def _failing_run(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess, float]:
    root = tmp_path / f"fail-{how}"
    command = [sys.executable, str(WORKLOADS / "sg_workloads.py"), "--devices", "2", "--steps", "50"]
    command += ["--fail", how, "--fail-rank", "1", "--timeout", "20", "--root", str(root)]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    elapsed = time.monotonic() - start
    time.sleep(0.5)
    assert wl.processes_mentioning(str(root)) == [], "a worker outlived the run"
    return done, elapsed


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_failing_worker_ends_the_run_naming_its_rank(tmp_path: Path, temp_dir) -> None:
    raised, raised_s = _failing_run(tmp_path, "raise")
    assert raised.returncode != 0
    assert temp_dir.left() == [], "the run left these in the temporary directory"
    assert "rank 1" in raised.stderr
    assert raised.stderr.count("RuntimeError: deliberate failure on rank 1") == 1, raised.stderr
    assert raised.stderr.count("Traceback (most recent call last)") == 1, raised.stderr
    # Well within the process-group timeout (20 s) on top of the start-up.
    assert raised_s < 60

    killed, killed_s = _failing_run(tmp_path, "kill")
    assert killed.returncode != 0
    assert "rank 1" in killed.stderr and "SIGKILL" in killed.stderr, killed.stderr
    assert killed_s < 60
    assert temp_dir.left() == [], "the run left these in the temporary directory"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_workers_start_where_the_temporary_folder_is_too_long_for_a_socket(tmp_path: Path, temp_dir) -> None:
    # A job's TMPDIR (a scratch folder, pytest's tmp_path under pytest-xdist) may be too long for the fork
    # server's socket, ``<TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX`` (AF_UNIX paths end at 107 bytes): the
    # socket goes to /tmp; the run, and what it leaves nowhere, stay under TMPDIR.
    long = temp_dir.path / ("t" * max(1, 80 - len(str(temp_dir.path))))
    long.mkdir()
    assert len(str(long)) + len("/pymp-XXXXXXXX/listener-XXXXXXXX") > 107
    root = tmp_path / "long-tmpdir"
    command = [sys.executable, str(WORKLOADS / "sg_workloads.py"), "--devices", "2", "--steps", "2"]
    command += ["--root", str(root), "--out", str(root / "out")]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=90, env={**os.environ, "TMPDIR": str(long)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # both ranks trained their two steps
        assert len(torch.load(f"{root / 'out'}.rank{rank}", weights_only=False)[0]["losses"]) == 2
    assert sorted(p.name for p in long.iterdir()) == [], "the run left these in its temporary directory"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_workers_and_leaves_nothing_behind(tmp_path: Path, temp_dir) -> None:
    """SIGINT to the launching process, as Ctrl-C in a terminal (the workers run in sessions of their own):
    the agent stops the workers, the script ends with KeyboardInterrupt, and the launch's folder is gone."""
    root = tmp_path / "interrupted"
    command = [sys.executable, str(WORKLOADS / "sg_workloads.py"), "--devices", "2", "--steps", "500"]
    command += ["--step-sleep", "0.1", "--ckpt-every", "1", "--root", str(root)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        # Training is under way on both ranks once a checkpoint is published (a full save gathers from both).
        while not (root / "run0" / "checkpoints" / "last").is_file():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    time.sleep(0.5)
    assert wl.processes_mentioning(str(root)) == [], "a worker outlived the run"
    assert temp_dir.left() == [], "the run left these in the temporary directory"
    assert process.returncode == -signal.SIGINT, err[-3000:]
    assert "KeyboardInterrupt" in err and "SignalException" not in err, err[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_function_raising_in_a_worker_raises_here_with_its_rank(temp_dir) -> None:
    engine = sg.Engine(strategy=wl.GradAverage(), accelerator="cpu", devices=2, timeout=20)
    with pytest.raises(sg.WorkerFailedError) as caught:
        engine.launch(wl.raise_on_rank_one)
    assert caught.value.rank == 1
    assert "ValueError: worker one gives up" in str(caught.value)
    # Neither the agent's error files nor torch.multiprocessing's pickled traceback of the failed function.
    assert temp_dir.left() == [], "the launch left these in the temporary directory"


def test_run_refuses_bad_input_before_launching(tmp_path: Path, stratagem_cli) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('should not run')\n")
    unknown = stratagem_cli("run", "--strategy", "dpp", "--devices", "2", str(script))
    assert unknown.returncode == 2 and "Unknown strategy 'dpp'" in unknown.stderr
    assert "should not run" not in unknown.stderr
    # A name with options (the workers' Engine reads them): the name is checked here, and the brackets.
    unknown = stratagem_cli("run", "--strategy", "dpp[static_graph=true]", "--devices", "2", str(script))
    assert unknown.returncode == 2 and "Unknown strategy 'dpp'" in unknown.stderr
    unread = stratagem_cli("run", "--strategy", "ddp[static_graph=true", "--devices", "2", str(script))
    assert unread.returncode == 2 and "--strategy: cannot read 'ddp[static_graph=true'" in unread.stderr
    missing = stratagem_cli("run", "--devices", "2", str(tmp_path / "absent.py"))
    assert missing.returncode == 2 and "no such script" in missing.stderr
    nodes = stratagem_cli("run", "--nnodes", "2", str(script))
    assert nodes.returncode == 2 and "--rdzv-endpoint" in nodes.stderr


def test_worker_environment_shares_the_cores_and_keeps_user_settings(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = _worker_start.worker_environment("cpu", {"X": "1"}, nproc_per_node=2)
    assert env[_worker_start.WORKER_ENV] == "1" and env["X"] == "1"
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in _worker_start.worker_environment("cpu", None, nproc_per_node=2)


def test_a_task_that_srun_started_gets_the_threads_of_an_elastic_worker() -> None:
    from stratagem.launchers import worker_threads

    cores = os.cpu_count() or 1
    assert worker_threads({"SLURM_CPUS_PER_TASK": "3", "SLURM_NTASKS": "8", "SLURM_NNODES": "2"}) == 3
    # No CPUs given per task: the node's cores shared by the step's tasks on it, as devices=4 would share them.
    assert worker_threads({"SLURM_NTASKS": "8", "SLURM_NNODES": "2"}) == max(1, cores // 4)
    assert worker_threads({"SLURM_NTASKS": "1", "SLURM_NNODES": "1"}) == cores


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_forked_workers_get_what_spawned_ones_would(tmp_path: Path) -> None:
    """Function workers are forked from a server that imported torch once: a worker still sees the launching
    process's environment as it is at the launch (a variable added after the server started, one removed), the
    compute threads OMP_NUM_THREADS asks for, and its exit handlers run; STRATAGEM_START_METHOD=spawn spawns."""
    script = WORKLOADS / "forked_launches.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    first, second, spawned = runs["first"], runs["second"], runs["spawned"]
    # Forked from one server (not the launcher), the same for both launches; spawned by the launcher.
    servers = {r["parent"] for r in first + second}
    assert len(servers) == 1 and runs["launcher"] not in servers, runs
    assert {r["parent"] for r in spawned} == {runs["launcher"]}, runs
    assert [r["gone"] for r in first] == ["1", "1"]
    assert [(r["gone"], r["added"]) for r in second] == [(None, "yes")] * 2, second
    # The default share of this machine's cores at the first launch; what OMP_NUM_THREADS=3 gives a new
    # interpreter (torch caps it at the physical cores) at the second, as the spawned workers show.
    assert [r["threads"] for r in first] == [max(1, (os.cpu_count() or 1) // 2)] * 2, first
    assert [r["threads"] for r in second] == [r["threads"] for r in spawned], (second, spawned)
    for launch in ("first", "second", "spawned"):
        for rank in (0, 1):
            assert (tmp_path / f"{launch}.{rank}").read_text() == "exit handlers ran", (launch, rank)


def test_an_unknown_start_method_is_refused_naming_the_methods(monkeypatch) -> None:
    from stratagem.launchers import _forked_workers

    monkeypatch.setenv("STRATAGEM_START_METHOD", "fork")
    with pytest.raises(sg.ConfigurationError, match="forkserver, spawn"):
        _worker_start.launch_function(print, (), nproc_per_node=2)
    monkeypatch.setenv("STRATAGEM_START_METHOD", "Spawn")
    assert _forked_workers.start_method() == "spawn"


def _script_launch(tmp_path: Path, name: str, command: list[str]) -> list[dict]:
    out = tmp_path / name
    _worker_start.launch_script([sys.executable, *command, str(out)], nproc_per_node=2)
    for rank in (0, 1):
        assert (tmp_path / f"{name}.exit.{rank}").read_text() == "exit handlers ran", (name, rank)
    # Each launch writes to a name of its own, "OUT" in what is compared.
    return [json.loads((tmp_path / f"{name}.{rank}").read_text().replace(str(out), "OUT")) for rank in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_forked_script_workers_see_what_spawned_ones_would(tmp_path: Path, monkeypatch) -> None:
    """A script run with devices=2 (this interpreter running a file or a module) starts its workers as forks of
    the fork server: each sees the argv, sys.path, __main__ and session a new interpreter would; its exit status
    and uncaught exception reach the launcher as a spawned worker's do, and its exit handlers run."""
    script = str(WORKLOADS / "forked_scripts.py")
    forked = _script_launch(tmp_path, "forked", [script])
    monkeypatch.setenv("STRATAGEM_START_METHOD", "spawn")
    spawned = _script_launch(tmp_path, "spawned", [script])
    monkeypatch.delenv("STRATAGEM_START_METHOD")
    # Forked from the server, not started by this process; a spawned worker is this process's child.
    assert {r.pop("parent") for r in spawned} == {os.getpid()}
    assert os.getpid() not in {r.pop("parent") for r in forked}
    assert forked == spawned
    assert forked[0]["path"][0] == str(WORKLOADS) and forked[0]["main"] and forked[0]["session_leader"]

    # python -m: sys.path starts at the working directory, argv[0] is the module's file.
    monkeypatch.chdir(WORKLOADS)
    module, other_rank = _script_launch(tmp_path, "module", ["-m", "forked_scripts"])
    assert module == other_rank
    assert module["path"][0] == str(WORKLOADS) and module["path"][1:] == forked[0]["path"][1:], module
    assert module["argv"] == [script, "OUT"] and module["spec"] == "forked_scripts", module
    assert os.getpid() != module["parent"]

    with pytest.raises(sg.WorkerFailedError) as exited:
        _worker_start.launch_script(
            [sys.executable, script, str(tmp_path / "e"), "exit", "3"], nproc_per_node=2
        )
    assert (exited.value.rank, exited.value.exitcode) == (1, 3)
    with pytest.raises(sg.WorkerFailedError) as raised:
        _worker_start.launch_script([sys.executable, script, str(tmp_path / "r"), "raise"], nproc_per_node=2)
    assert (raised.value.rank, raised.value.exitcode) == (1, 1)
    # The traceback starts at the script, as the interpreter's does.
    frames = raised.value.detail.split("Traceback (most recent call last):\n", 1)[1]
    assert frames.startswith(f'  File "{script}", line ') and "runpy" not in frames, raised.value.detail
    assert "ValueError: deliberate failure in the script" in raised.value.detail
