"""What runs in each Ray actor: the rank environment set, then the script (as ``__main__``) or the function."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Any

from stratagem.launchers import ERROR_FILE_ENV


class _Worker:
    """One worker process of the run (a Ray actor). Ray prefixes its output with ``repr(self)``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:
        return f"rank {self.rank}"

    def where(self, run: str) -> tuple[str, str, str]:
        """Its Ray node, that node's address, and where on the node it records a failure that ends its
        process at once (the hang watchdog's): the driver reads that file there if the process dies. The file
        is in the Ray session's folder on the node, beside the worker's logs: a worker whose node was cut off
        leaves it with them rather than in the node's temporary folder."""
        import ray

        context = ray.get_runtime_context()
        folder = os.path.join(context.get_temp_dir(), context.get_session_name())
        if not os.path.isdir(folder):
            folder = context.get_temp_dir()
        error_file = os.path.join(folder, f"stratagem-rank{self.rank}-{run}.json")
        return context.get_node_id(), ray.util.get_node_ip_address(), error_file

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(
        self, env: dict[str, str], kind: str, command: list[str], function: Any, args: tuple, cwd: str
    ) -> Any:
        os.environ.update(env)
        if os.path.isdir(cwd):
            os.chdir(cwd)
        # Ray forwards the actor's output line by line; a block-buffered stream would hold it back, and an
        # actor ended by the driver would lose what it held.
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        try:
            if kind == "function":
                return function(*args)
            return _run_command(command)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # A failure that reached here travels to the driver as an exception: the file is not needed.
            with contextlib.suppress(OSError):
                os.unlink(env.get(ERROR_FILE_ENV, ""))


def _run_command(command: list[str]) -> None:
    """Run ``python ...`` arguments in this process as ``__main__`` (a script, ``-m module`` or ``-c code``)."""
    import runpy

    args = command[1:]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise RuntimeError(f"the script exited with {stop.code!r}") from None
