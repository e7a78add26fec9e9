"""The batch job: its ``sbatch`` options and its script.

The script runs on the job's first node. It exports the job's environment, takes that node as the rendezvous
(``MASTER_ADDR``, a free ``MASTER_PORT`` for each attempt) and runs one ``srun`` step per attempt: every task
one worker under :mod:`stratagem_slurm._task`, each task's output in a file of its own. ``--kill-on-bad-exit``
ends the step as soon as one task fails, so that its peers do not wait for it until their collectives time
out. A failed attempt starts again while ``max_restarts`` allows (``STRATAGEM_RESTART_COUNT`` counts them, and
the Trainer resumes from its newest checkpoint). The script's last act is to write the final status, which the
launcher waits for.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from stratagem_slurm._task import CALL_FILE

STATUS_FILE = "status"
BATCH_SCRIPT = "job.sh"
BATCH_OUTPUT = "batch.out"


def attempt_dir(job_dir: Path, attempt: int) -> Path:
    return job_dir / f"attempt-{attempt}"


@attrs.frozen(kw_only=True)
class Request:
    """What to ask SLURM for, and what to run in it."""

    job_name: str
    partition: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int | None
    gpus_per_node: int | None
    time: str | None
    extra: tuple[str, ...]
    #: The worker: a command line (a script job), or ``None`` for a function job (``call.pkl``).
    command: tuple[str, ...] | None
    env: Mapping[str, str]
    setup: tuple[str, ...]
    max_restarts: int


def sbatch_arguments(request: Request, job_dir: Path) -> list[str]:
    arguments = [
        f"--job-name={request.job_name}",
        f"--partition={request.partition}",
        f"--nodes={request.nodes}",
        f"--ntasks-per-node={request.tasks_per_node}",
        f"--output={job_dir / BATCH_OUTPUT}",
        f"--chdir={os.getcwd()}",
        "--export=ALL",
        # A node failure ends the run and the launcher reports it; resuming a requeued job is not this launcher's.
        "--no-requeue",
    ]
    if request.cpus_per_task is not None:
        arguments.append(f"--cpus-per-task={request.cpus_per_task}")
    if request.gpus_per_node:
        arguments.append(f"--gpus-per-node={request.gpus_per_node}")
    if request.time is not None:
        arguments.append(f"--time={request.time}")
    return [*arguments, *request.extra]


def _worker_command(request: Request, job_dir: Path) -> list[str]:
    if request.command is not None:
        return list(request.command)
    return [sys.executable, "-m", "stratagem_slurm._task", "call", str(job_dir)]


def script(request: Request, job_dir: Path) -> str:
    """The batch script's text."""
    python = shlex.quote(sys.executable)
    srun = ["srun", "--kill-on-bad-exit=1"]
    if request.cpus_per_task is not None:
        # Since SLURM 22.05 a step does not inherit the job's --cpus-per-task.
        srun.append(f"--cpus-per-task={request.cpus_per_task}")
    srun += ['--output="$attempt_dir"/rank-%t.out', '--error="$attempt_dir"/rank-%t.err']
    task = [python, "-m", "stratagem_slurm._task", "task", '"$attempt_dir"', "--"]
    worker = " ".join(shlex.quote(part) for part in _worker_command(request, job_dir))
    exports = [f"export {key}={shlex.quote(value)}" for key, value in sorted(request.env.items())]
    lines = [
        "#!/bin/bash",
        "# Written by stratagem-slurm: " + worker.replace("\n", " "),
        *request.setup,
        *exports,
        f"job_dir={shlex.quote(str(job_dir))}",
        f"export STRATAGEM_MAX_RESTARTS={request.max_restarts}",
        # The first node's address as SLURM reaches it (NodeAddr), its name where none is set.
        'first_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'node_addr="$(scontrol show node -o "$first_node" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")"',
        'export MASTER_ADDR="${node_addr:-$first_node}"',
        "status=1",
        f"for attempt in $(seq 0 {request.max_restarts}); do",
        '  export STRATAGEM_RESTART_COUNT="$attempt"',
        f'  export MASTER_PORT="$({python} -m stratagem_slurm._task free-port)"',
        '  attempt_dir="$job_dir"/attempt-"$attempt"',
        '  mkdir -p "$attempt_dir"',
        f"  {' '.join(srun)} {' '.join(task)} {worker}",
        '  status="$?"',
        '  if [ "$status" -eq 0 ]; then break; fi',
        "done",
        f'echo "$status" > "$job_dir"/{STATUS_FILE}.tmp && mv "$job_dir"/{STATUS_FILE}.tmp "$job_dir"/{STATUS_FILE}',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


#: What a function job's worker needs of the launching process to unpickle its call (see ``_task.run_call``).
_PREPARATION_KEYS = ("sys_path", "sys_argv", "dir", "init_main_from_name", "init_main_from_path")


def write(request: Request, job_dir: Path, call: tuple | None) -> Path:
    """Write the batch script (and a function job's pickled call) into ``job_dir``; the script's path."""
    import pickle
    from multiprocessing import spawn

    if call is not None:
        preparation = spawn.get_preparation_data("stratagem-slurm")
        preparation = {k: v for k, v in preparation.items() if k in _PREPARATION_KEYS}
        (job_dir / CALL_FILE).write_bytes(pickle.dumps(preparation) + pickle.dumps(call))
    path = job_dir / BATCH_SCRIPT
    path.write_text(script(request, job_dir))
    path.chmod(0o700)
    return path


def quoted(arguments: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in arguments)
