"""What runs on the compute nodes: ``python -m stratagem_slurm._task ...`` from the batch script.

- ``free-port``: print a free TCP port of this node (the batch script's choice of ``MASTER_PORT``).
- ``task DIR -- COMMAND...``: one SLURM task, one worker. Gives the worker the rank environment the
  ``launch_workers`` hook promises (from ``SLURM_PROCID`` and friends), its compute threads, and a file of its
  own where an uncaught exception is recorded (``DIR/error-RANK.json``, the elastic agent's format); runs
  ``COMMAND`` as a child, passes signals on, and notes how and when it ended in ``DIR/exit-RANK.json``, which
  a worker killed by a signal could not do itself.
- ``call JOB_DIR``: the worker of a function job: prepares itself as a process that ``multiprocessing`` spawns
  (the launching script imported as ``__mp_main__``, so that its functions unpickle, as under the elastic
  launcher), then calls the pickled ``(function, args)`` of ``JOB_DIR/call.pkl``; rank 0 writes what it
  returned to ``JOB_DIR/result.pkl``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CALL_FILE = "call.pkl"
RESULT_FILE = "result.pkl"
#: Signals a task passes on to its worker (SLURM signals every process of a step on cancel; ``srun`` and
#: ``scancel --signal`` may reach the task alone).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def error_file(directory: Path, rank: int) -> Path:
    return directory / f"error-{rank}.json"


def exit_file(directory: Path, rank: int) -> Path:
    return directory / f"exit-{rank}.json"


def tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node ``node`` from SLURM's ``2(x3),1`` notation (two tasks on each of three nodes, then one)."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[node] if node < len(counts) else counts[-1]


def rank_environment(environ: dict[str, str], directory: Path) -> dict[str, str]:
    from stratagem.launchers import ERROR_FILE_ENV, worker_threads

    rank, node = int(environ["SLURM_PROCID"]), int(environ.get("SLURM_NODEID", "0"))
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or "1"
    env = {
        **environ,
        "RANK": str(rank),
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_WORLD_SIZE": str(tasks_on_node(spec, node)),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "STRATAGEM_WORKER": "1",
        ERROR_FILE_ENV: str(error_file(directory, rank)),
        # The launcher streams rank 0's output from its file while it runs: no block buffering.
        "PYTHONUNBUFFERED": "1",
    }
    if "OMP_NUM_THREADS" not in environ:
        # Threads as the elastic launcher gives a worker (the launcher left the login node's count out).
        env["OMP_NUM_THREADS"] = str(worker_threads(environ))
    return env


def run_task(directory: Path, command: list[str]) -> int:
    env = rank_environment(dict(os.environ), directory)
    rank = int(env["RANK"])
    child = subprocess.Popen(command, env=env)
    for number in FORWARDED:
        signal.signal(number, lambda received, _frame: child.send_signal(received))
    code = child.wait()
    note = {"exitcode": code, "time": time.time()}
    path = exit_file(directory, rank)
    path.with_suffix(".tmp").write_text(json.dumps(note))
    path.with_suffix(".tmp").replace(path)
    # A signal's death as a shell reports it.
    return code if code >= 0 else 128 - code


def run_call(job_dir: Path) -> int:
    from stratagem.launchers import record_exception

    try:
        from multiprocessing import spawn

        with open(job_dir / CALL_FILE, "rb") as file:  # written by the launching process of this job
            spawn.prepare(pickle.load(file))
            function, args = pickle.load(file)
        result = function(*args)
        if os.environ.get("RANK") == "0":
            temporary = job_dir / (RESULT_FILE + ".tmp")
            temporary.write_bytes(pickle.dumps(result))
            temporary.replace(job_dir / RESULT_FILE)
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (None, 0):
            return 0
        if not record_exception(type(error), error, error.__traceback__):
            raise
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # Past here the interpreter would tear down a live process group from arbitrary threads.
        os._exit(1)
    return 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def main(argv: list[str]) -> int:
    if argv[:1] == ["free-port"]:
        print(free_port())
        return 0
    if argv[:1] == ["task"] and len(argv) > 3 and argv[2] == "--":
        return run_task(Path(argv[1]), argv[3:])
    if argv[:1] == ["call"] and len(argv) == 2:
        return run_call(Path(argv[1]))
    print(f"usage: python -m stratagem_slurm._task free-port | task DIR -- COMMAND... | call DIR; got {argv}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
