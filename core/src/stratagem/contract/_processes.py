"""Child processes and listening ports, for the teardown checks (Linux ``/proc``; ``None`` elsewhere)."""

from __future__ import annotations

import os
import socket

#: multiprocessing's resource tracker lives as long as its parent by design; it is no leftover worker.
_SERVICE_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def child_processes(pid: int) -> list[str] | None:
    """``"pid: command"`` of every live or unreaped child of ``pid``, or ``None`` without ``/proc``."""
    if not os.path.isdir("/proc"):
        return None
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if int(fields[1]) != pid or any(s in command for s in _SERVICE_PROCESSES):
            continue
        state = "zombie" if fields[0] == "Z" else "running"
        children.append(f"{entry} ({state}): {command[:200]}")
    return sorted(children)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something still listens on ``port`` (connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
