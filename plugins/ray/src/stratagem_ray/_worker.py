"""What runs in each Ray actor: the rank environment set, then the script (as ``__main__``) or the function."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any


class _Worker:
    """One worker process of the run (a Ray actor). Ray prefixes its output with ``repr(self)``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:
        return f"rank {self.rank}"

    def where(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

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
