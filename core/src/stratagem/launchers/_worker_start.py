"""Starting worker processes with torch's elastic agent (``torch.distributed.launcher.api``).

Two ways in, one agent:

- :func:`launch_script` re-runs the user's command line in N workers with the rank environment set; the
  launching process only supervises (what ``python train.py`` with ``devices=2`` does, and ``stratagem run``).
- :func:`launch_function` runs a picklable function in N workers and returns rank 0's result (what
  ``Engine.launch(fn)`` does when nothing launched the processes already). The workers are forked from a
  process that has imported torch once (:mod:`stratagem.launchers._forked_workers`).

Either way, a worker that raises or dies stops the others at once; the caller gets a
:class:`~stratagem.errors.WorkerFailedError` naming the first rank that failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from stratagem.checkpoint import _scratch
from stratagem.errors import ConfigurationError, WorkerFailedError
from stratagem.launchers import _forked_workers
from stratagem.launchers._failure_records import (
    ERROR_FILE_ENV,
    _note_failure_time,
    describe_failure,
    record_exception,
)

#: Set in every worker stratagem starts, so that nothing in it launches again.
WORKER_ENV = "STRATAGEM_WORKER"
#: glibc keeps freed buffers above its dynamic mmap threshold in the heap; FSDP's all-gather buffers then
#: pile up in RSS. A fixed threshold returns them to the OS; huge pages for malloc's mappings keep the page
#: faults of fresh buffers from costing step time (measured in benchmarks/allocator.py).
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _environment(extra: Mapping[str, str | None]) -> Iterator[None]:
    # The agent hands its own environment to the workers; set ours around the launch only (None: unset).
    saved = {key: os.environ.get(key) for key in extra}
    for key, value in extra.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def worker_environment(
    accelerator: str, extra: Mapping[str, str] | None = None, nproc_per_node: int = 1
) -> dict[str, str]:
    env = {WORKER_ENV: "1", **(extra or {})}
    if accelerator == "cpu":
        for key, value in CPU_ALLOCATOR_ENV.items():
            # The user's own setting wins.
            if key not in os.environ:
                env[key] = value
        if "OMP_NUM_THREADS" not in os.environ:
            # N workers each starting one compute thread per core would fight over the cores.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    return env


def worker_threads(environ: Mapping[str, str] | None = None) -> int:
    """Compute threads (``OMP_NUM_THREADS``) for a worker that a scheduler started as a task of its own, one
    worker per task: the CPUs the task was given (``SLURM_CPUS_PER_TASK``), else this node's cores shared
    evenly by the tasks on it, as the elastic launcher shares them among its workers.

    :param environ: the task's environment (default: this process's).
    """
    env = os.environ if environ is None else environ
    given = env.get("SLURM_CPUS_PER_TASK", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    tasks_here = int(env.get("SLURM_NTASKS", "1")) // max(int(env.get("SLURM_NNODES", "1")), 1)
    return max(1, (os.cpu_count() or 1) // max(tasks_here, 1))


def set_task_threads(accelerator: str) -> None:
    """Under ``srun``, where no stratagem launcher set ``OMP_NUM_THREADS``: set this process's compute threads as
    the elastic launcher sets a worker's, so that ``srun -n 2 python train.py`` computes what ``python
    train.py`` with ``devices=2`` computes (torch's default, one thread per core, changes how sums round)."""
    if accelerator != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    threads = worker_threads()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes this task starts (loader workers)
    import torch

    torch.set_num_threads(threads)


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    # The agent logs every start and a table per failure, and torch.multiprocessing each worker it stops after
    # another failed; stratagem reports the failure itself, once.
    names = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _rendezvous(
    nnodes: int | str,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    run_id: str | None,
    rdzv_configs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """How the agents of a run find each other: one node alone, a fixed node rank, or c10d (elastic)."""
    min_nodes, max_nodes = parse_nnodes(nnodes)
    if max_nodes > 1 and not rdzv_endpoint:
        raise WorkerFailedError(
            None, None, "Several nodes need --rdzv-endpoint host:port, the same on every node."
        )
    if max_nodes == 1 and not rdzv_endpoint:
        backend, endpoint, configs = "c10d", f"127.0.0.1:{free_port()}", {}
    elif node_rank is not None:
        # A fixed node rank is the static rendezvous: node 0 hosts the store at the endpoint.
        backend, endpoint, configs = "static", rdzv_endpoint, {"rank": node_rank}
    else:
        backend, endpoint, configs = "c10d", rdzv_endpoint, {}
    configs = {**configs, **(rdzv_configs or {})}
    return dict(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        # Every node's agent must use the same run id to find the others' keys in the rendezvous store.
        run_id=run_id or (f"stratagem-{rdzv_endpoint}" if rdzv_endpoint else uuid.uuid4().hex),
        rdzv_backend=backend,
        rdzv_endpoint=endpoint or "",
        rdzv_configs=configs,
    )


def parse_nnodes(nnodes: int | str) -> tuple[int, int]:
    """``2`` or ``"2"`` -> (2, 2); ``"1:2"`` -> (1, 2): elastic membership between MIN and MAX nodes."""
    text = str(nnodes)
    low, sep, high = text.partition(":")
    try:
        min_nodes, max_nodes = int(low), int(high if sep else low)
    except ValueError:
        raise ConfigurationError(f"--nnodes {text!r}: give N or MIN:MAX (whole numbers).") from None
    if min_nodes < 1 or max_nodes < min_nodes:
        raise ConfigurationError(
            f"--nnodes {text!r}: need 1 <= MIN <= MAX (MIN:MAX is the range of nodes a run may have)."
        )
    return min_nodes, max_nodes


def _run(
    entrypoint: Callable | str,
    args: list[Any],
    env: Mapping[str, str],
    *,
    nproc_per_node: int,
    nnodes: int | str,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    run_id: str | None,
    max_restarts: int = 0,
    rdzv_configs: Mapping[str, Any] | None = None,
) -> dict[int, Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from stratagem.launchers import _elastic_agent

    check_max_restarts(max_restarts)
    rendezvous = _rendezvous(nnodes, node_rank, rdzv_endpoint, run_id, rdzv_configs)
    # The agent's folder: removed when the run ends however it ends (after the failure records are read, below);
    # named so that the next launch removes it if this process is killed.
    with _scratch.folder("agent") as scratch:
        restart_log = scratch / _elastic_agent.RESTART_LOG
        restart_log.touch()
        # The workers share the agent's store, which outlives a restart with the failed attempt's keys; the
        # strategies keep each attempt's keys apart (ClusterEnvironment.restart_count).
        agent_env = {**env, _elastic_agent.RESTART_LOG_ENV: str(restart_log)}
        start_method = "spawn"
        script = None if callable(entrypoint) else _forked_workers.script_arguments([entrypoint, *args])
        if callable(entrypoint) or script is not None:
            start_method = _forked_workers.start_method()
        if start_method == "forkserver" and script is not None:
            # This interpreter running a script or a module: forked workers run it.
            command = [entrypoint, *args]
            entrypoint, args = (
                _forked_workers.run_script,
                [command, script, _forked_workers.interpreter_path()],
            )
        if start_method == "forkserver":
            # Before the launch's environment is set: the server outlives this launch.
            server_env: dict[str, str | None] = {k: v for k, v in env.items() if k in CPU_ALLOCATOR_ENV}
            with _environment({**server_env, **dict.fromkeys(_forked_workers.PER_WORKER_ENV)}):
                _forked_workers.ensure_server()
        with _environment(agent_env), _quiet_agent():
            try:
                return _elastic_agent.run_agent(
                    entrypoint=entrypoint,
                    args=list(args),
                    nproc_per_node=nproc_per_node,
                    max_restarts=max_restarts,
                    scratch=scratch,
                    start_method=start_method,
                    **rendezvous,
                )
            except ChildFailedError as error:
                failed = describe_failure(error.failures)
                if max_restarts:
                    failed = WorkerFailedError(
                        failed.rank,
                        failed.exitcode,
                        f"{failed.detail}\ngave up after {max_restarts} restart(s)",
                    )
                raise failed from None


def check_max_restarts(max_restarts: Any) -> None:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigurationError(
            f"max_restarts={max_restarts!r}: give 0 (no restart) or a positive number of restarts."
        )


def launch_function(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nproc_per_node: int,
    accelerator: str = "cpu",
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in every worker; return ``{rank: result}`` of this node's workers."""
    return _run(
        call_recording,
        [fn, *args],
        worker_environment(accelerator, env, nproc_per_node),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        run_id=None,
        max_restarts=max_restarts,
    )


def current_command() -> list[str]:
    """The command line that started this interpreter (``python script.py args``, ``python -m pkg``)."""
    argv = list(getattr(sys, "orig_argv", []) or [sys.executable, *sys.argv])
    return [sys.executable, *argv[1:]]


def launch_script(
    command: list[str],
    *,
    nproc_per_node: int,
    accelerator: str = "cpu",
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    rdzv_configs: Mapping[str, Any] | None = None,
) -> None:
    """Run ``command`` (an executable and its arguments) in every worker and wait for all of them."""
    _run(
        command[0],
        command[1:],
        worker_environment(accelerator, env, nproc_per_node),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        run_id=None,
        max_restarts=max_restarts,
        rdzv_configs=rdzv_configs,
    )


def supervise_script(
    nproc_per_node: int, accelerator: str, env: Mapping[str, str] | None = None, max_restarts: int = 0
) -> None:
    """Re-run this very command in ``nproc_per_node`` workers, then end this process with their status.

    The launching process only supervises: the rest of the script ran in the workers.
    """
    try:
        launch_script(
            current_command(),
            nproc_per_node=nproc_per_node,
            accelerator=accelerator,
            env=env,
            max_restarts=max_restarts,
        )
    except WorkerFailedError as error:
        raise SystemExit(f"stratagem: {error}") from None
    raise SystemExit(0)


def call_recording(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a worker, noting the time of an exception for the launcher's report
    (:func:`stratagem.launchers.describe_failure`)."""
    _forked_workers.adopt_launch_environment()
    try:
        return fn(*args)
    except BaseException as error:
        if not isinstance(error, SystemExit):
            _note_failure_time(error)
        raise


def install_worker_excepthook() -> None:
    """In a worker running a script, record an uncaught exception where the agent reads it.

    Under stratagem's own launcher the supervising process prints the failing rank's traceback once, so the
    worker does not print it too (the other ranks' follow-on errors would repeat it).
    """
    if ERROR_FILE_ENV not in os.environ or getattr(sys.excepthook, "_stratagem", False):
        return
    previous = sys.excepthook
    supervised = os.environ.get(WORKER_ENV) == "1"

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        recorded = record_exception(kind, value, tb)
        if not (recorded and supervised):
            previous(kind, value, tb)
        # The failure is on record: end here. Interpreter shutdown would destroy a live process group from
        # arbitrary threads and can abort ("terminate called without an active exception", SIGABRT), which
        # would hide the exception behind a signal; exit hooks of a failed worker have nothing left to do.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    hook._stratagem = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_uncaught: list[BaseException] = []


def uncaught_exception() -> bool:
    """Whether an exception reached the top of this process (seen by :func:`watch_uncaught`'s hook)."""
    return bool(_uncaught)


def watch_uncaught() -> None:
    """Note uncaught exceptions, so that exit handlers can tell a failing process from a finishing one."""
    if getattr(sys.excepthook, "_stratagem_watch", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        _uncaught.append(value)
        previous(kind, value, tb)

    hook._stratagem_watch = True  # type: ignore[attr-defined]
    sys.excepthook = hook
