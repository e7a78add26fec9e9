"""The plugin's own tests: registration, refusals, restarts and stopping, with real (tiny) worker processes.

Its certification by stratagem's contract suite runs with the repository's launchers, in one run
(tests/test_contract_all.py); ``stratagem contract --launcher subprocess`` runs it alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem import WorkerFailedError, get_registry
from stratagem.errors import ConfigurationError
from stratagem.launchers import LaunchJob
from stratagem_subprocess.launcher import SubprocessLauncher


def test_registered_through_the_entry_point() -> None:
    info = get_registry().get_launcher("subprocess")
    assert info.plugin.distribution == "stratagem-subprocess-launcher"
    assert (info.capabilities.multi_node, info.capabilities.accelerators) == (False, {"cpu", "cuda"})
    assert type(info.create()) is SubprocessLauncher


@pytest.mark.parametrize("bad", [0, -1.0, True, "5"])
def test_bad_options_are_refused_with_the_option_named(bad: object) -> None:
    with pytest.raises(
        ConfigurationError, match=r"SubprocessLauncher\(stop_timeout=.*positive number of seconds"
    ):
        SubprocessLauncher(stop_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on this machine only"):
        SubprocessLauncher().launch_workers(LaunchJob(kind="script", command=("true",), nnodes=2))


def _script(code: str, **job: object) -> LaunchJob:
    return LaunchJob(kind="script", command=(sys.executable, "-c", code), nproc_per_node=2, **job)


#: Rank 1 fails in the first start of the group, and succeeds once restarted.
FLAKY = "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' and os.environ['STRATAGEM_RESTART_COUNT'] == '0' else 0)"


def test_a_failed_group_is_restarted_as_the_job_allows(capfd: pytest.CaptureFixture[str]) -> None:
    assert SubprocessLauncher().launch_workers(_script(FLAKY, max_restarts=1)) == {}
    assert "rank 1 failed; restarting the workers (1 of 1 restarts)" in capfd.readouterr().err
    with pytest.raises(WorkerFailedError) as caught:
        SubprocessLauncher().launch_workers(_script(FLAKY))
    assert (caught.value.rank, caught.value.exitcode) == (1, 3)


def test_sigterm_to_the_launching_process_stops_the_workers(tmp_path: Path) -> None:
    # A launching process whose two workers would sleep for a minute, each noting its pid first.
    sleeper = f"import os, time; open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').write(str(os.getpid())); time.sleep(60)"
    code = (
        "import sys\n"
        "from stratagem.launchers import LaunchJob\n"
        "from stratagem_subprocess.launcher import SubprocessLauncher\n"
        f"job = LaunchJob(kind='script', command=(sys.executable, '-c', {sleeper!r}), nproc_per_node=2)\n"
        "SubprocessLauncher(stop_timeout=2).launch_workers(job)\n"
    )
    launching = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int((tmp_path / rank).read_text() or 0) for rank in ("0", "1")]
        launching.send_signal(signal.SIGTERM)
        assert launching.wait(timeout=30) == 128 + signal.SIGTERM
        assert "SIGTERM: stopping the workers" in launching.stderr.read()  # type: ignore[union-attr]
        assert [pid for pid in pids if _alive(pid)] == [], "workers outlived their launcher"
    finally:
        for pid in [p for p in pids if _alive(p)]:
            os.kill(pid, signal.SIGKILL)
        if launching.poll() is None:
            launching.kill()
            launching.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_function_job_returns_every_ranks_result() -> None:
    job = LaunchJob(kind="function", function=json.dumps, args=({"rank": 1},), nproc_per_node=2)
    assert SubprocessLauncher().launch_workers(job) == {0: '{"rank": 1}', 1: '{"rank": 1}'}


#: A user's script: the function it launches is defined in its ``__main__``, which the workers must import.
SCRIPT = """
import stratagem as sg


def main(engine, offset):
    import torch

    total = engine.all_reduce(torch.tensor([float(engine.rank + offset)]), "sum")
    return {"rank": engine.rank, "world": engine.world_size, "sum": total.item()}


if __name__ == "__main__":
    engine = sg.Engine(strategy="auto", accelerator="cpu", devices=2, launcher="subprocess")
    print("result:", engine.launch(main, 10))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_engine_launch_of_a_function_defined_in_the_users_script(tmp_path: Path) -> None:
    # What the contract suite does not try: a function that pickles as __main__.main, through the Engine.
    (tmp_path / "script.py").write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=280
    )
    assert "result: {'rank': 0, 'world': 2, 'sum': 21.0}" in done.stdout, done.stdout + done.stderr[-3000:]
