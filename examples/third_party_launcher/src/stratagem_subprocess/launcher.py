"""``subprocess``: the workers of a run as plain child processes of the launching one, on this machine.

Written from stratagem's documentation ("Writing a launcher" in docs/plugin-authors.md) with its public API
alone. Each worker is ``subprocess.Popen`` of the job's command (a script job) or of this package's
``worker`` module (a function job), with the rank environment, ``job.env``, and a file of its own where
stratagem records its uncaught exception. The launcher polls them; the first that fails has its peers
stopped, and the run's failure is what :func:`stratagem.launchers.describe_failure` makes of their ends.
``job.max_restarts`` starts the group again.

Left out on purpose, to stay small: several nodes (declared, so the core refuses them), and preemption (a
signal to the launching process stops the workers; they save nothing).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing import spawn
from pathlib import Path
from typing import Any

from stratagem import hookimpl
from stratagem.errors import ConfigurationError, WorkerFailedError
from stratagem.launchers import (
    ERROR_FILE_ENV,
    LOST_PEER_GRACE_S,
    Launcher,
    LaunchJob,
    WorkerExit,
    describe_failure,
    is_lost_peer,
)
from stratagem_subprocess.worker import CALL_FILE, result_file

#: What a function job's worker needs of ``multiprocessing.spawn.get_preparation_data`` to import the script.
_PREPARATION_KEYS = ("sys_path", "sys_argv", "dir", "init_main_from_name", "init_main_from_path")


class _Stopped(SystemExit):
    """The launching process was asked to stop (SIGTERM): it exits as the signal would have ended it (128 + the
    signal's number), once the workers are stopped."""


class SubprocessLauncher(Launcher):
    """Start the workers of a run as child processes of this one, on this machine.

    :param stop_timeout: seconds a worker has to end after SIGTERM, when its peer failed or the run is
        interrupted, before it is killed.
    :param poll_interval: seconds between looks at the workers.
    """

    def __init__(self, stop_timeout: float = 5.0, poll_interval: float = 0.05) -> None:
        for option, value in (("stop_timeout", stop_timeout), ("poll_interval", poll_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(
                    f"SubprocessLauncher({option}={value!r}): give a positive number of seconds."
                )
        self.stop_timeout = float(stop_timeout)
        self.poll_interval = float(poll_interval)

    @hookimpl
    def launch_workers(self, job: LaunchJob) -> dict[int, Any]:
        if job.max_nodes > 1:
            raise ConfigurationError(
                f"The subprocess launcher starts workers on this machine only; the job asks for nnodes="
                f"{job.nnodes!r}. Use a launcher that declares multi_node (`stratagem launchers` lists them)."
            )
        last: WorkerFailedError | None = None
        with tempfile.TemporaryDirectory(prefix="stratagem-subprocess-") as scratch:
            for attempt in range(job.max_restarts + 1):
                outcome = self._attempt(job, Path(scratch) / f"attempt-{attempt}", attempt)
                if not isinstance(outcome, WorkerFailedError):
                    return outcome
                last = outcome
                if attempt < job.max_restarts:
                    print(
                        f"stratagem: rank {last.rank} failed; restarting the workers ({attempt + 1} of "
                        f"{job.max_restarts} restarts).",
                        file=sys.stderr,
                        flush=True,
                    )
        assert last is not None
        if job.max_restarts:
            last = WorkerFailedError(
                last.rank, last.exitcode, f"{last.detail}\ngave up after {job.max_restarts} restart(s)"
            )
        raise last

    # one start of the group -------------------------------------------------------------------------------
    def _attempt(self, job: LaunchJob, folder: Path, attempt: int) -> dict[int, Any] | WorkerFailedError:
        """Every rank's result, or the failure that ended this start of the group."""
        folder.mkdir(parents=True)
        command = list(job.command) if job.kind == "script" else _function_command(job, folder)
        port = _free_port()
        workers: dict[int, subprocess.Popen] = {}
        ended: dict[int, WorkerExit] = {}
        try:
            with _stopped_by_sigterm():
                for rank in range(job.nproc_per_node):
                    env = {**os.environ, **job.env, **_rank_environment(job, rank, port, attempt)}
                    env[ERROR_FILE_ENV] = str(folder / f"error-{rank}.json")
                    # A session of its own: stopping the worker stops what it started (data loader workers).
                    workers[rank] = subprocess.Popen(command, env=env, start_new_session=True)
                self._wait(workers, ended, folder)
        finally:
            self._stop(workers)
        failed = {rank: end for rank, end in ended.items() if end.exitcode != 0}
        if failed:
            return describe_failure(failed)
        if job.kind == "script":
            return {}
        return {
            rank: pickle.loads(result_file(folder, rank).read_bytes())
            for rank in workers
            if result_file(folder, rank).is_file()
        }

    def _wait(self, workers: dict[int, subprocess.Popen], ended: dict[int, WorkerExit], folder: Path) -> None:
        """Until every worker ended, or one failed (then a while longer if its failure is only a collective that
        lost its peer: the peer's own failure, the cause, is on its way)."""
        deadline = None
        while len(ended) < len(workers):
            for rank, process in workers.items():
                code = process.poll()
                if rank not in ended and code is not None:
                    error_file = str(folder / f"error-{rank}.json")
                    ended[rank] = WorkerExit(exitcode=code, timestamp=time.time(), error_file=error_file)
            failed = {rank: end for rank, end in ended.items() if end.exitcode != 0}
            if failed:
                if not is_lost_peer(describe_failure(failed).detail):
                    return
                deadline = deadline or time.monotonic() + LOST_PEER_GRACE_S
                if time.monotonic() > deadline:
                    return
            time.sleep(self.poll_interval)

    def _stop(self, workers: dict[int, subprocess.Popen]) -> None:
        """SIGTERM to every worker still running (and what it started), then SIGKILL after ``stop_timeout``."""
        running = [p for p in workers.values() if p.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _rank_environment(job: LaunchJob, rank: int, port: int, attempt: int) -> dict[str, str]:
    """What docs/plugin-authors.md says every worker gets: its place in the run, and which start this is."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(job.nproc_per_node),
        "LOCAL_WORLD_SIZE": str(job.nproc_per_node),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "STRATAGEM_WORKER": "1",
        "STRATAGEM_RESTART_COUNT": str(attempt),
        "STRATAGEM_MAX_RESTARTS": str(job.max_restarts),
    }


def _function_command(job: LaunchJob, folder: Path) -> list[str]:
    """The command of a function job's workers, the function pickled beside it (after what a spawned process
    needs to import the launching script, so that a function defined there unpickles)."""
    preparation = spawn.get_preparation_data("stratagem-subprocess-worker")
    with open(folder / CALL_FILE, "wb") as file:
        # Only what locates the script: the rest (the authentication key above all) does not pickle.
        pickle.dump({key: preparation[key] for key in _PREPARATION_KEYS if key in preparation}, file)
        pickle.dump((job.function, tuple(job.args)), file)
    return [sys.executable, "-m", "stratagem_subprocess.worker", str(folder)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM to this process raises here, so that the workers are stopped rather than left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number: int, _frame: Any) -> None:
        print(f"stratagem: {signal.Signals(number).name}: stopping the workers.", file=sys.stderr, flush=True)
        raise _Stopped(128 + number)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
