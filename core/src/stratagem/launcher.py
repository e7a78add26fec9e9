"""Starting worker processes with torch's elastic agent (``torch.distributed.launcher.api``).

Two ways in, one agent:

- :func:`launch_script` re-runs the user's command line in N workers with the rank environment set; the
  launching process only supervises (what ``python train.py`` with ``devices=2`` does, and ``stratagem run``).
- :func:`launch_function` runs a picklable function in N spawned workers and returns rank 0's result
  (what ``Engine.launch(fn)`` does when nothing launched the processes already).

Either way, a worker that raises or dies stops the others at once; the caller gets a
:class:`~stratagem.errors.WorkerFailedError` naming the first rank that failed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from stratagem.errors import WorkerFailedError

#: Set in every worker stratagem starts, so that nothing in it launches again.
WORKER_ENV = "STRATAGEM_WORKER"
#: Beside the agent's error file, a worker notes when it failed (see :func:`_root_failure`).
FAILURE_SUFFIX = ".stratagem.json"
#: glibc keeps freed buffers above its dynamic mmap threshold in the heap; FSDP's all-gather buffers then
#: pile up in RSS. A fixed threshold returns them to the OS; huge pages for malloc's mappings keep the page
#: faults of fresh buffers from costing step time (measured in benchmarks/allocator.py).
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _environment(extra: Mapping[str, str]) -> Iterator[None]:
    # The agent hands its own environment to the workers; set ours around the launch only.
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
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


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    # The agent logs every start and a table per failure; stratagem reports the failure itself, once.
    loggers = [
        logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _config(
    nproc_per_node: int,
    nnodes: int,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    run_id: str | None,
) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    if nnodes > 1 and not rdzv_endpoint:
        raise WorkerFailedError(
            None, None, "Several nodes need --rdzv-endpoint host:port, the same on every node."
        )
    if nnodes == 1 and not rdzv_endpoint:
        backend, endpoint, configs = "c10d", f"127.0.0.1:{free_port()}", {}
    elif node_rank is not None:
        # A fixed node rank is the static rendezvous: node 0 hosts the store at the endpoint.
        backend, endpoint, configs = "static", rdzv_endpoint, {"rank": node_rank}
    else:
        backend, endpoint, configs = "c10d", rdzv_endpoint, {}
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        # Every node's agent must use the same run id to find the others' keys in the rendezvous store.
        run_id=run_id or (f"stratagem-{rdzv_endpoint}" if rdzv_endpoint else uuid.uuid4().hex),
        rdzv_backend=backend,
        rdzv_endpoint=endpoint or "",
        rdzv_configs=configs,
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=5,
    )


def _failure_time(failure: Any) -> float | None:
    """When the worker recorded its exception (sub-second), or ``None`` if it recorded none."""
    path = getattr(failure, "error_file", "")
    if not path or not os.path.isfile(path + FAILURE_SUFFIX):
        return None
    try:
        return float(json.loads(open(path + FAILURE_SUFFIX).read())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _root_failure(error: Any) -> tuple[int, Any]:
    """The failure that started it all.

    The agent orders failures by whole seconds, so a rank that failed because its peer vanished can tie with
    the peer. A worker that died without recording an exception (a signal other than the agent's SIGTERM,
    ``sys.exit(n)``) is a root cause: a lost peer shows up as an exception. Otherwise the earliest recorded
    exception is.
    """
    failures = dict(error.failures)
    silent = [
        (f.timestamp, rank, f)
        for rank, f in failures.items()
        if _failure_time(f) is None and f.exitcode not in (0, -signal.SIGTERM)
    ]
    if silent:
        _, rank, failure = min(silent, key=lambda item: item[:2])
        return rank, failure
    timed = [(t, rank, f) for rank, f in failures.items() if (t := _failure_time(f)) is not None]
    if timed:
        _, rank, failure = min(timed, key=lambda item: item[:2])
        return rank, failure
    return error.get_first_failure()


def _describe(error: Any) -> WorkerFailedError:
    rank, failure = _root_failure(error)
    exitcode = failure.exitcode
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            detail = f"killed by signal {signal.Signals(-exitcode).name}"
            return WorkerFailedError(rank, exitcode, detail)
    message = failure.message if isinstance(failure.message, str) else ""
    if "To enable traceback" in message:  # the agent's placeholder when no error file was written
        message = ""
    data = failure.error_file_data or {}
    stack = ""
    if isinstance(data.get("message"), dict):
        stack = data["message"].get("extraInfo", {}).get("py_callstack", "")
    detail = (stack or message or "no traceback recorded (see the worker's output above)").rstrip()
    return WorkerFailedError(rank, exitcode, detail)


def _run(
    entrypoint: Callable | str, args: list[Any], env: Mapping[str, str], **config: Any
) -> dict[int, Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import launch_agent

    launch_config = _config(**config)
    with _environment(env), _quiet_agent():
        try:
            return launch_agent(launch_config, entrypoint, list(args))
        except ChildFailedError as error:
            raise _describe(error) from None


def launch_function(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nproc_per_node: int,
    accelerator: str = "cpu",
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in every worker; return ``{rank: result}`` of this node's workers."""
    return _run(
        _call_recording,
        [fn, *args],
        worker_environment(accelerator, env, nproc_per_node),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        run_id=None,
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
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
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
    )


def supervise_script(nproc_per_node: int, accelerator: str, env: Mapping[str, str] | None = None) -> None:
    """Re-run this very command in ``nproc_per_node`` workers, then end this process with their status.

    The launching process only supervises: the rest of the script ran in the workers.
    """
    try:
        launch_script(current_command(), nproc_per_node=nproc_per_node, accelerator=accelerator, env=env)
    except WorkerFailedError as error:
        raise SystemExit(f"stratagem: {error}") from None
    raise SystemExit(0)


def _call_recording(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a spawned worker, noting the time of an exception for :func:`_root_failure`."""
    try:
        return fn(*args)
    except BaseException as error:
        if not isinstance(error, SystemExit):
            _note_failure_time()
        raise


def _note_failure_time() -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            with open(path + FAILURE_SUFFIX, "w") as file:
                json.dump({"time": time.time()}, file)


def record_exception(kind: type[BaseException], value: BaseException, tb: Any) -> bool:
    """Write the exception where the agent reads it (its error-file format); False if there is nowhere to."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {
        "message": {
            "message": f"{kind.__name__}: {value}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:
        return False
    _note_failure_time()
    return True


def install_worker_excepthook() -> None:
    """In a worker running a script, record an uncaught exception where the agent reads it.

    Under stratagem's own launcher the supervising process prints the failing rank's traceback once, so the
    worker does not print it too (the other ranks' follow-on errors would repeat it).
    """
    if "TORCHELASTIC_ERROR_FILE" not in os.environ or getattr(sys.excepthook, "_stratagem", False):
        return
    previous = sys.excepthook
    supervised = os.environ.get(WORKER_ENV) == "1"

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        recorded = record_exception(kind, value, tb)
        if not (recorded and supervised):
            previous(kind, value, tb)

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
