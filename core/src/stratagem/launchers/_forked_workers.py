"""Function workers forked from a process that has imported torch already: multiprocessing's fork server.

A spawned worker is a new interpreter, which imports torch and stratagem before it runs a line of the
function: about 3 s of CPU per worker on a small machine, paid again at every launch and every restart. The
fork server imports them once, the first time this process launches a function; each worker is then a fork of
it, and a launch or a restart from the same process starts its workers in a fraction of a second
(``benchmarks/worker_start.py`` measures both).

What a worker sees stays what a spawned one would see:

- The server only imports (no torch computation: no compute threads, no CUDA), so forking it is safe; it is
  the start method torch documents for CUDA beside spawn.
- Its environment is the launching process's when the worker starts, not the server's: the agent hands each
  worker the whole environment (:func:`environment_for_worker`), and the worker drops what the launching
  process no longer has (:func:`adopt_launch_environment`). Compute threads follow ``OMP_NUM_THREADS`` as a
  new interpreter would.
- Exit handlers (``atexit``) run when the worker's function is done, as at a spawned worker's exit.

``STRATAGEM_START_METHOD=spawn`` starts every function worker as a new interpreter instead. Scripts
(``python train.py`` with ``devices=2``, ``stratagem run``) are new processes either way: they re-run a command.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import tempfile
import threading

from stratagem.errors import ConfigurationError

__all__ = ["START_METHOD_ENV", "adopt_launch_environment", "environment_for_worker", "start_method"]

#: ``forkserver`` (the default where the platform has it) or ``spawn``.
START_METHOD_ENV = "STRATAGEM_START_METHOD"
START_METHODS = ("forkserver", "spawn")
#: In a forked worker: the names of the server's environment variables that the launching process did not have
#: when the worker started (JSON list).
_UNSET_ENV = "STRATAGEM_UNSET_ENV"
#: What every worker imports before its first line of work. Only torch's own modules and stratagem's core:
#: a plugin may change torch when imported (DeepSpeed does), which must stay in the runs that use it.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "stratagem",
    "stratagem.engine",
    "stratagem.trainer",
)

#: Each worker's own (adopt_launch_environment sets its compute threads): the server starts without them, so
#: that its default is what a new interpreter's would be.
PER_WORKER_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_lock = threading.Lock()
#: The environment the server was started with (what a forked worker inherits), once it runs.
_server_environment: dict[str, str] | None = None
#: Where the server's socket lives: the temporary directory of the moment this module was imported, not a
#: run's or a test's, which may be removed while the server still listens.
_home = os.environ.get("TMPDIR") or "/tmp"


def start_method() -> str:
    """``forkserver`` or ``spawn``: how :func:`~stratagem.launchers.launch_function`'s workers start."""
    chosen = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if chosen and chosen not in START_METHODS:
        raise ConfigurationError(
            f"{START_METHOD_ENV}={chosen!r}: give one of {', '.join(START_METHODS)} (forkserver, the default, "
            "forks each worker from a process that has imported torch; spawn starts a new interpreter)."
        )
    if chosen == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    # The agent's hook that hands each worker its environment (torch 2.8 and later); without it a forked
    # worker would keep the server's.
    if not hasattr(LocalElasticAgent, "_set_local_rank_env"):
        return "spawn"
    return "forkserver"


def ensure_server() -> None:
    """Start the fork server if it does not run, with this process's environment as it is now: the caller sets
    what is read once at a process's start (the C allocator's settings), for every worker forked from it, and
    leaves out :data:`PER_WORKER_ENV`."""
    global _server_environment
    from multiprocessing import forkserver, process, util

    with _lock:
        server = forkserver._forkserver
        if server._forkserver_pid is not None and not os.waitpid(server._forkserver_pid, os.WNOHANG)[0]:
            return
        config = process.current_process()._config
        if "tempdir" not in config:
            saved = tempfile.tempdir
            tempfile.tempdir = _home if os.path.isdir(_home) else None
            try:
                util.get_temp_dir()
            finally:
                tempfile.tempdir = saved
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        server.ensure_running()
        _server_environment = dict(os.environ)


def environment_for_worker(worker_env: dict[str, str]) -> None:
    """Complete one worker's environment (the agent's, ``worker_env``) with this process's as it is now, and
    name what the server has that this process has not, for the worker to drop."""
    for key, value in os.environ.items():
        worker_env.setdefault(key, value)
    # A server started elsewhere in this process (not by ensure_server): what it has is unknown.
    gone = sorted(set(_server_environment or {}) - set(worker_env))
    worker_env[_UNSET_ENV] = json.dumps(gone)


def adopt_launch_environment() -> None:
    """In a worker: take the launching process's environment and settings as a spawned worker would have."""
    gone = os.environ.pop(_UNSET_ENV, None)
    if gone is None:
        return  # spawned: it is a new interpreter already
    for key in json.loads(gone):
        os.environ.pop(key, None)
    tempfile.tempdir = None  # read again from TMPDIR
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        wanted = int(threads)
        if torch.backends.mkl.is_available():
            # A new interpreter's torch takes MKL's thread count, which is at most the physical cores: the
            # count the server (started with no OMP_NUM_THREADS) has now.
            wanted = min(wanted, torch.get_num_threads())
        torch.set_num_threads(wanted)
    # A forked worker ends with os._exit after its function: run the exit handlers as an interpreter would.
    from multiprocessing import util

    util.Finalize(None, atexit._run_exitfuncs, exitpriority=0)
