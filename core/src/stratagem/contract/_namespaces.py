"""Network namespaces for :mod:`stratagem.contract.hosts`: ``ip netns`` and the processes inside a namespace.

A namespace made by ``ip netns add NAME`` is held by a bind mount at ``/run/netns/NAME``; deleting the name
removes the mount, and the namespace itself (with its links) goes when the last process in it goes. So the
processes come first: every process whose ``/proc/PID/ns/net`` is the namespace's inode is in it, whatever its
parent or session. A zombie has no namespace left and does not count.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable

NETNS_DIR = "/run/netns"


class NamespaceError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and what it said."""


def ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NamespaceError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


def add(name: str) -> int:
    """Make the namespace ``name``, with its loopback up; its inode."""
    ip("netns", "add", name)
    ip("link", "set", "lo", "up", namespace=name)
    return inode(name)


def inode(name: str) -> int:
    return os.stat(os.path.join(NETNS_DIR, name)).st_ino


def delete(name: str) -> None:
    # `ip netns del` of a name that is gone already is no error here: teardown may run twice.
    if os.path.exists(os.path.join(NETNS_DIR, name)):
        ip("netns", "del", name)


def names(prefix: str) -> list[str]:
    """The namespaces whose name starts with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def _command(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read().replace(b"\0", b" ").decode(errors="replace").strip()


def processes(inodes: set[int]) -> dict[int, tuple[int, str]]:
    """``{pid: (namespace inode, command)}`` of the live processes in any of these namespaces."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            number = os.stat(f"/proc/{entry}/ns/net").st_ino
            if number in inodes:
                found[int(entry)] = (number, _command(entry)[:200])
        except OSError:  # gone meanwhile, or a zombie
            continue
    return found


def wait_entered(process: subprocess.Popen, inode: int, timeout: float = 10.0) -> None:
    """Wait until ``process`` runs in the namespace ``inode`` (or has ended, or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if os.stat(f"/proc/{process.pid}/ns/net").st_ino == inode:
                return
        except OSError:
            return
        time.sleep(0.01)


def kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (by parent links; a child in a session of its own included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parent = int(file.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def kill(
    inodes: set[int], timeout: float = 10.0, reap: Callable[[], object] = lambda: None
) -> dict[int, str]:
    """SIGKILL every process in these namespaces until none is left (a dying process may have forked);
    ``reap`` collects this process's own children meanwhile. What is still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        reap()
        left = processes(inodes)
        if not left or time.monotonic() > deadline:
            return {pid: command for pid, (_, command) in left.items()}
        kill_pids(left)
        time.sleep(0.05)


def owner_alive(name: str, prefix: str) -> bool:
    """Whether the process that made the namespace ``PREFIX<pid>-...`` still runs."""
    pid = name[len(prefix) :].split("-", 1)[0]
    return not pid.isdigit() or os.path.exists(f"/proc/{pid}")
