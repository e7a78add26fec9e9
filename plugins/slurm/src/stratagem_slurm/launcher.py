"""``slurm``: the workers of a run as the tasks of one SLURM batch job, submitted from a login node.

Why ``sbatch`` directly and not submitit: stratagem's main case is a script that re-runs itself in every worker
(``python train.py`` on the login node, the same script in the tasks), which is an ``srun`` line in a batch
script, not a pickled function; the launcher must also follow a job to its end without ``sacct``, which needs
SLURM's accounting database (many clusters, this repository's test cluster among them, have none, and
submitit reads job states from it). A batch script, ``squeue`` and files in the job's folder do all of it with
the commands every login node has, and no dependency.

A run: check that a controller answers and that the partition exists and can hold the request, write the batch
script (see :mod:`stratagem_slurm._batch`), ``sbatch`` it, stream rank 0's output while the job runs, and
return rank 0's result or raise the error of the rank that failed first. Ctrl-C (or any error while
waiting) cancels the job before it returns.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stratagem.errors import ConfigurationError
from stratagem.hookspecs import hookimpl
from stratagem.launchers import Launcher, LaunchJob
from stratagem_slurm import _batch, _follow, _slurm
from stratagem_slurm._task import CALL_FILE, RESULT_FILE


def _positive(name: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number < 1 or str(number) != str(value).strip():
        raise ConfigurationError(f"SlurmLauncher({name}={value!r}): give a positive whole number.")
    return number


def _lines(name: str, value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not all(isinstance(v, str) for v in value):
        raise ConfigurationError(f"SlurmLauncher({name}={value!r}): give a string or a list of strings.")
    return tuple(value)


class SlurmLauncher(Launcher):
    """Run the workers as one SLURM batch job: ``num_nodes`` nodes, ``devices`` tasks on each, one worker per
    task.

    :param partition: where to submit (default: ``SBATCH_PARTITION``, else the cluster's default partition).
    :param time: the job's time limit, in sbatch's forms (``"1:00:00"``, ``"2-00:00:00"``) or whole minutes.
    :param cpus_per_task: CPUs for each worker (default: SLURM's, one); its compute threads follow.
    :param account: ``--account``. :param qos: ``--qos``. :param mem: ``--mem`` (per node, ``"32G"``).
    :param constraint: ``--constraint`` (node features).
    :param job_name: default ``stratagem-<script>``.
    :param folder: where each job gets a folder for its batch script and its tasks' output; it must be shared
        with the compute nodes (default ``./stratagem-slurm``, beside where SLURM writes ``slurm-*.out``).
    :param sbatch_args: more ``sbatch`` options, as a list or one string (``"--exclusive --mail-type=END"``).
    :param setup: shell lines the batch script runs first (``"module load cuda"``,
        ``"source venv/bin/activate"``).
    :param poll_interval: seconds between reads of rank 0's output.
    """

    def __init__(
        self,
        partition: str | None = None,
        time: str | int | None = None,
        cpus_per_task: int | None = None,
        account: str | None = None,
        qos: str | None = None,
        mem: str | None = None,
        constraint: str | None = None,
        job_name: str | None = None,
        folder: str | os.PathLike[str] | None = None,
        sbatch_args: str | Sequence[str] = (),
        setup: str | Sequence[str] = (),
        poll_interval: float = 0.2,
    ) -> None:
        self.partition = partition
        self.time = None if time is None else str(time)
        if self.time is not None and not re.fullmatch(r"[0-9:-]+|UNLIMITED|INFINITE", self.time):
            raise ConfigurationError(
                f"SlurmLauncher(time={time!r}): give minutes or [DAYS-]HOURS:MINUTES:SECONDS, as sbatch --time."
            )
        self.cpus_per_task = _positive("cpus_per_task", cpus_per_task)
        options = {"account": account, "qos": qos, "mem": mem, "constraint": constraint}
        extra = [f"--{key}={value}" for key, value in options.items() if value is not None]
        if isinstance(sbatch_args, str):
            sbatch_args = shlex.split(sbatch_args)
        self.sbatch_args = (*extra, *_lines("sbatch_args", sbatch_args))
        self.setup = _lines("setup", setup)
        self.job_name = job_name
        self.folder = Path(folder) if folder is not None else None
        if not float(poll_interval) > 0:
            raise ConfigurationError(f"SlurmLauncher(poll_interval={poll_interval!r}): give seconds above 0.")
        self.poll_interval = float(poll_interval)

    # the hook --------------------------------------------------------------------------------------------
    @hookimpl
    def launch_workers(self, job: LaunchJob) -> dict[int, Any]:
        nodes = _nodes(job)
        _slurm.require_reachable()
        partition = _slurm.choose_partition(self.partition or os.environ.get("SBATCH_PARTITION") or None)
        _slurm.check_fits(
            partition, nodes=nodes, tasks_per_node=job.nproc_per_node, cpus_per_task=self.cpus_per_task or 1
        )
        call = None
        if job.kind == "function":
            call = (job.function, tuple(job.args))
            try:
                pickle.dumps(call)
            except Exception as error:  # pickling raises several types
                raise ConfigurationError(
                    f"launcher='slurm': the function cannot be sent to the job ({type(error).__name__}: "
                    f"{error}). Define it at module level of a module the compute nodes can import."
                ) from error
        request = self._request(job, partition.name, nodes)
        job_dir = self._job_dir(request.job_name)
        script = _batch.write(request, job_dir, call)
        job_id = _slurm.submit(_batch.sbatch_arguments(request, job_dir), str(script))
        print(
            f"stratagem: submitted SLURM job {job_id}: {nodes} node(s) x {job.nproc_per_node} task(s) in "
            f"partition {partition.name}; its files are in {job_dir}",
            file=sys.stderr,
            flush=True,
        )
        return self._follow(job_id, job_dir, job.kind)

    # parts -----------------------------------------------------------------------------------------------
    def _request(self, job: LaunchJob, partition: str, nodes: int) -> _batch.Request:
        env = dict(job.env)
        if "OMP_NUM_THREADS" not in os.environ:
            # Counted from this machine's cores; each task counts its own node's instead.
            env.pop("OMP_NUM_THREADS", None)
        return _batch.Request(
            job_name=self.job_name or _default_name(job),
            partition=partition,
            nodes=nodes,
            tasks_per_node=job.nproc_per_node,
            cpus_per_task=self.cpus_per_task,
            gpus_per_node=job.nproc_per_node if job.accelerator == "cuda" else None,
            time=self.time,
            extra=self.sbatch_args,
            command=tuple(job.command) if job.kind == "script" else None,
            env=env,
            setup=self.setup,
            max_restarts=job.max_restarts,
        )

    def _job_dir(self, name: str) -> Path:
        folder = self.folder if self.folder is not None else Path.cwd() / "stratagem-slurm"
        job_dir = folder.resolve() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        job_dir.mkdir(parents=True)
        return job_dir

    def _follow(self, job_id: str, job_dir: Path, kind: str) -> dict[int, Any]:
        try:
            status = _follow.Follower(job_id, job_dir, self.poll_interval).wait()
        except BaseException:  # Ctrl-C above all: the job must not outlive the launcher that waits for it
            print(f"stratagem: cancelling SLURM job {job_id}.", file=sys.stderr, flush=True)
            _slurm.cancel(job_id)
            raise
        _slurm.wait_until_gone(job_id)
        (job_dir / CALL_FILE).unlink(missing_ok=True)
        if status != 0:
            raise _follow.failure(job_id, job_dir, _follow.attempts_made(job_dir), status)
        if kind != "function":
            return {}
        produced = job_dir / RESULT_FILE
        with open(produced, "rb") as file:
            result = pickle.load(file)  # written by rank 0 of this job
        produced.unlink()
        return {0: result}


def _nodes(job: LaunchJob) -> int:
    if ":" in str(job.nnodes):
        raise ConfigurationError(
            f"nnodes={job.nnodes!r}: a SLURM job has a fixed number of nodes; give one number (elastic "
            "membership is the elastic launcher's)."
        )
    if job.node_rank is not None or job.rdzv_endpoint:
        raise ConfigurationError(
            "launcher='slurm' starts every node of the run from one submission: drop --node-rank and "
            "--rdzv-endpoint."
        )
    return job.max_nodes


def _default_name(job: LaunchJob) -> str:
    """``stratagem-<script>``: of the script the job re-runs, or of the one that launches the function."""
    parts = [p for p in job.command[1:] if not p.startswith("-")] if job.kind == "script" else sys.argv[:1]
    stem = Path(parts[0]).stem if parts and parts[0] else "run"
    return "stratagem-" + re.sub(r"[^A-Za-z0-9_.-]", "_", stem)
