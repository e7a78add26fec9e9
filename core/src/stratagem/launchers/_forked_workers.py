"""Workers forked from a process that has imported torch already: multiprocessing's fork server.

A spawned worker is a new interpreter, which imports torch and stratagem before it runs a line of the
function: about 3 s of CPU per worker on a small machine, paid again at every launch and every restart. The
fork server imports them once, the first time this process launches; each worker is then a fork of it, and a
launch or a restart from the same process starts its workers in a fraction of a second
(``benchmarks/worker_start.py`` measures both).

Function workers (``Engine.launch(fn)``, ``Trainer.fit`` from Python) run the function. Script workers (a
script run with ``devices=2``, ``stratagem run``) are forked too when the command is this interpreter running a
file or a module (``python train.py ARGS``, ``python -m pkg ARGS``, no interpreter option: see
:func:`script_arguments`): :func:`run_script` runs it there with :mod:`runpy`. Any other command (another
executable, ``python -u ...``) starts as a new process. A fresh ``python train.py`` launch starts its own server,
so it saves only the CPU of one interpreter's imports; its restarts, and launches from a process whose server
runs already (``stratagem run`` called in a test's process), save the workers' imports whole.

What a worker sees stays what a spawned one would see:

- The server only imports (no torch computation: no compute threads, no CUDA), so forking it is safe; it is
  the start method torch documents for CUDA beside spawn.
- Its environment is the launching process's when the worker starts, not the server's: the agent hands each
  worker the whole environment (:func:`environment_for_worker`), and the worker drops what the launching
  process no longer has (:func:`adopt_launch_environment`). Compute threads follow ``OMP_NUM_THREADS`` as a
  new interpreter would.
- Exit handlers (``atexit``) run when the worker's function or script is done, as at a spawned worker's exit.
- A script worker has the ``sys.argv``, ``sys.orig_argv``, ``sys.path`` (asked of a new interpreter once per
  environment: :func:`interpreter_path`), ``__main__``, command line (``ps``) and session of its own that the
  agent's new process would have; an uncaught exception goes to ``sys.excepthook`` (stratagem's records it)
  and exits 1, ``SystemExit`` gives its status, Ctrl-C ends it by the signal.

What differs: a forked worker is the server's child, not the launching process's; its standard streams are the
server's (the launching process's when the server started; a process that moves its own file descriptors
later, as pytest's capture does, keeps the workers' output where it was), and its standard input is empty.

``STRATAGEM_START_METHOD=spawn`` starts every worker, function or script, as a new interpreter instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Iterator, Sequence

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
#: The server's socket is ``<home>/pymp-XXXXXXXX/listener-XXXXXXXX``, and an AF_UNIX path ends at 107 bytes.
_SOCKET_PATH_MAX = 107
_SOCKET_TAIL = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def _socket_home() -> str | None:
    """The folder for the server's socket: :data:`_home`, or ``/tmp`` where ``_home``'s path is too long for a
    socket (a job's scratch folder, pytest's ``tmp_path``); ``None``: the temporary folder of the moment."""
    for home in (_home, "/tmp"):
        if os.path.isdir(home) and len(os.fsencode(home)) + _SOCKET_TAIL <= _SOCKET_PATH_MAX:
            return home
    return None


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
            tempfile.tempdir = _socket_home()
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


#: The launching process's environment variables that change a new interpreter's ``sys.path``.
_PATH_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONSAFEPATH")
_interpreter_paths: dict[tuple[str | None, ...], list[str]] = {}


def script_arguments(command: Sequence[str]) -> list[str] | None:
    """What follows the interpreter in ``command`` when a forked worker can run it: this interpreter running a
    script (``python path/to/train.py ARGS``) or a module (``python -m NAME ARGS``), with no interpreter
    option. None for anything else (another executable, ``python -u ...``), which starts as a new process."""
    if len(command) < 2 or os.environ.get("PYTHONSAFEPATH"):
        return None
    found = shutil.which(command[0])
    if found is None or os.path.abspath(found) != os.path.abspath(sys.executable):
        return None
    first = command[1]
    if first == "-m":
        return list(command[1:]) if len(command) > 2 else None
    if first.startswith("-") or not os.path.exists(first):
        return None
    return list(command[1:])


def interpreter_path() -> list[str]:
    """``sys.path`` of a new interpreter of this executable without its first entry (the script's folder), as
    the environment of this process gives it now; asked of one once per environment."""
    key = tuple(os.environ.get(name) for name in _PATH_ENV)
    if key not in _interpreter_paths:
        code = "import json, sys; print(json.dumps(sys.path[1:]))"
        found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        _interpreter_paths[key] = json.loads(found.stdout)
    return list(_interpreter_paths[key])


@contextlib.contextmanager
def no_main_to_import() -> Iterator[None]:
    """While script workers start: a process started by multiprocessing first imports its launcher's main
    module (as ``__mp_main__``, for the functions defined there); a script worker runs the script itself, and
    must not run it twice."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def run_script(command: list[str], arguments: list[str], path: list[str]) -> None:
    """In a forked worker: run a script (``arguments`` = ``[path, *args]``) or a module (``["-m", name, *args]``)
    as ``command`` would in a new interpreter: ``sys.argv``, ``sys.path``, ``__main__``, a session of its own,
    an uncaught exception given to ``sys.excepthook`` and exit status 1, ``SystemExit``'s status, exit handlers."""
    adopt_launch_environment()
    _show_command(command)
    os.setsid()  # as the agent starts a script's worker: its DataLoader workers are in its process group
    module = arguments[1] if arguments[0] == "-m" else None
    first = os.getcwd() if module is not None else os.path.dirname(os.path.realpath(arguments[0]))
    sys.path[:] = [first, *path]
    sys.argv = list(arguments)
    sys.orig_argv = list(command)
    importlib.invalidate_caches()  # files written since the server started
    try:
        if module is not None:
            sys.argv = ["-m", *arguments[2:]]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(arguments[0]), run_name="__main__")
    except SystemExit:
        raise  # multiprocessing turns its code into the exit status as the interpreter does
    except BaseException as error:
        tb = error.__traceback__
        # The interpreter's traceback starts at the script's first line, not in runpy or here.
        while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, runpy.__name__):
            tb = tb.tb_next
        sys.excepthook(type(error), error, tb)
        if isinstance(error, KeyboardInterrupt):
            # The interpreter ends by the signal after its exit handlers.
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            atexit._run_exitfuncs()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None


def _show_command(command: list[str]) -> None:
    """Have the worker's command line (``/proc/PID/cmdline``: ps, top, a search for leftover workers) be the
    script's, as a spawned worker's is, instead of the fork server's: written over the server's in place (the
    memory the kernel reads it from), cut to its length."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end: fields 48 and 49 of proc(5)
    except (OSError, IndexError, ValueError):
        return
    text = "\0".join(command).encode()[: end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)
