"""Several hosts on this machine, for tests of what only shows across machines: host names and addresses, a
rendezvous on another host, a host that drops off the network, per-host scratch, one shared folder.

Each :class:`Host` is a network namespace with an address on a network that only the namespaces of one
:class:`Hosts` share (a bridge in a namespace of its own; nothing is routed to or from the machine's own
network), its loopback up, and, for every command it runs, a host name of its own (``h0``, ``h1``, ...) and
a hosts file naming every host of the set (a UTS and a mount namespace per command). gloo binds to what the
host name resolves to, so processes on different hosts reach each other by name as on a cluster. The folder
``Hosts.shared`` stands in for the cluster's file system; each host may have a local folder of its own, its
``TMPDIR``. The faults a cluster has: :meth:`Host.cut` takes the host's link down (its packets are dropped,
nobody is told) and :meth:`Host.reconnect` brings it back; :meth:`Host.kill` ends every process in the host.

:meth:`Hosts.close` ends every process in the hosts and removes the namespaces, and with them the links;
:meth:`Hosts.check` fails a test that left a process running in a host. Making namespaces needs root and
Linux (:func:`why_unavailable`). The pytest plugin (:mod:`stratagem.contract.plugin`) hands these out as the
fixtures ``make_hosts`` and ``stratagem_hosts``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stratagem.contract import _namespaces as ns

__all__ = ["Host", "Hosts", "HostsUnavailableError", "LeftBehindError", "why_unavailable"]

#: Names of the namespaces start with this, then the pid of the process that made them.
PREFIX = "sgh"
#: The hosts' network: h0 is .1, h1 .2, ... Only the namespaces of one set of hosts are on it.
SUBNET = "10.231.0"
TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname")
_serial = itertools.count()

# Run inside the host's namespaces (sh -c SCRIPT NAME HOSTS_FILE COMMAND...): its host name, its hosts file.
_ENTER = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


class HostsUnavailableError(RuntimeError):
    """Hosts cannot be made here; the message says why and what to do."""


class LeftBehindError(AssertionError):
    """A test or a teardown left processes or namespaces behind; the message lists them."""


def why_unavailable() -> str | None:
    """Why hosts cannot be made on this machine (not Linux, not root, a tool missing), or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"hosts are Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "making network namespaces needs root: run the tests as root (CI does)"
    # Found on PATH, as the hosts run them.
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found on PATH: as root, apt-get install iproute2 util-linux mount hostname "
            "(and /usr/sbin on PATH)"
        )
    return None


class Host:
    """One host of a :class:`Hosts`: its name, address, folders, the commands it runs and its faults."""

    def __init__(self, hosts: Hosts, index: int, local: Path | None) -> None:
        self.hosts, self.index = hosts, index
        #: Its host name, which every host's hosts file resolves to :attr:`address`.
        self.name = f"h{index}"
        self.address = f"{SUBNET}.{index + 1}"
        #: The network namespace (``ip netns`` name).
        self.namespace = f"{hosts.base}-{self.name}"
        #: Its local folder (``TMPDIR`` of its commands), or ``None``.
        self.local = local
        self._port = f"p{index}"  # its link's end on the bridge

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address})"

    @property
    def shared(self) -> Path:
        return self.hosts.shared

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs it on this host (from the machine's own namespaces)."""
        enter = ["nsenter", f"--net={ns.NETNS_DIR}/{self.namespace}", "unshare", "--uts", "--mount"]
        return [*enter, "sh", "-c", _ENTER, self.name, str(self.hosts.hosts_file), *map(str, argv)]

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment with ``TMPDIR`` at the local folder, updated with ``env``."""
        merged = dict(os.environ)
        if self.local is not None:
            merged["TMPDIR"] = str(self.local)
        merged.update(env or {})
        return merged

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        daemon: bool = False,
        **kwargs: Any,
    ) -> subprocess.Popen:
        """Start ``argv`` on this host (``subprocess.Popen`` arguments in ``kwargs``; a session of its own).

        ``daemon=True``: a service meant to outlive a test (a SLURM daemon), which :meth:`Hosts.check` does not
        count as left behind; :meth:`Hosts.close` ends it with everything else.
        """
        kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(argv), env=self.environment(env), **kwargs)
        self.hosts._started.append(process)
        if daemon:
            self.hosts._daemons.add(process.pid)
        # Not on the host until nsenter has entered its namespace: a check made before would not see it.
        ns.wait_entered(process, self.hosts._inodes[self.namespace])
        return process

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        check: bool = False,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to its end, its output captured as text. After ``timeout`` seconds it and
        every process it started are killed and ``subprocess.TimeoutExpired`` is raised, with the output."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        process = self.popen(argv, env=env, **kwargs)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            ns.kill_pids(ns.descendants(process.pid))
            out, err = process.communicate()
            raise subprocess.TimeoutExpired(process.args, timeout, out, err) from None
        done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def add_daemon(self, pid: int) -> None:
        """Count process ``pid`` on this host as a daemon (see :meth:`popen`): a helper that a daemon forked
        (``slurmctld``'s ``slurmscriptd``), or a service that a command left running when it returned."""
        self.hosts._daemons.add(pid)

    def pids(self) -> dict[int, str]:
        """``{pid: command}`` of every live process on this host."""
        inode = self.hosts._inodes[self.namespace]
        return {pid: command for pid, (_, command) in ns.processes({inode}).items()}

    # faults --------------------------------------------------------------------------------------------
    def cut(self) -> None:
        """Take the host off the network: its link goes down at the bridge, as a pulled cable or a dead switch
        port. Packets to and from it are dropped; no connection is reset and its processes go on running."""
        ns.ip("link", "set", self._port, "down", namespace=self.hosts.network)

    def reconnect(self) -> None:
        """Bring the host's link back up after :meth:`cut`."""
        ns.ip("link", "set", self._port, "up", namespace=self.hosts.network)

    def kill(self) -> None:
        """End every process on this host at once (SIGKILL), as a machine that loses power: the host stays,
        and new commands may run on it."""
        left = ns.kill({self.hosts._inodes[self.namespace]}, reap=self.hosts._reap)
        if left:
            raise LeftBehindError(f"{self.name}: processes survived SIGKILL: {left}")


class Hosts:
    """``count`` hosts (``h0`` .. ``h{count-1}``) on one network of their own; see the module's docstring.

    :param count: how many hosts.
    :param root: a folder for this set: ``shared/`` (:attr:`shared`), ``local/h0``... and the hosts file.
    :param local: give each host a local folder (its commands' ``TMPDIR``).
    """

    def __init__(self, count: int, root: Path, *, local: bool = True) -> None:
        if not 1 <= count <= 254:
            raise ValueError(f"count={count}: give 1 to 254 hosts (one /24 network).")
        #: Every name of this set starts with it: the maker's pid and a serial number.
        self.base = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        #: The namespace holding the bridge that the hosts' links plug into.
        self.network = f"{self.base}-net"
        self.root = Path(root)
        #: The folder every host sees (the cluster's shared file system).
        self.shared = self.root / "shared"
        self.hosts_file = self.root / "etc" / "hosts"
        self.hosts = [Host(self, i, self.root / "local" / f"h{i}" if local else None) for i in range(count)]
        self._inodes: dict[str, int] = {}
        self._started: list[subprocess.Popen] = []
        self._daemons: set[int] = set()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Any:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        left = self.close()
        if left and exc[0] is None:
            raise LeftBehindError("left behind after teardown: " + "; ".join(left))

    def start(self) -> Hosts:
        """Make the network and the hosts. Raises :class:`HostsUnavailableError` where namespaces cannot be
        made; whatever was made before an error is removed."""
        reason = why_unavailable()
        if reason is not None:
            raise HostsUnavailableError(reason)
        _remove_orphans()
        self.shared.mkdir(parents=True, exist_ok=True)
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost", *(f"{h.address} {h.name}" for h in self.hosts)]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        try:
            self._make_network()
        except ns.NamespaceError as error:
            self.close()
            if "Operation not permitted" in str(error):
                raise HostsUnavailableError(f"network namespaces cannot be made here: {error}") from error
            raise
        return self

    def _make_network(self) -> None:
        self._inodes[self.network] = ns.add(self.network)
        ns.ip("link", "add", "br0", "type", "bridge", namespace=self.network)
        ns.ip("link", "set", "br0", "up", namespace=self.network)
        for host in self.hosts:
            if host.local is not None:
                host.local.mkdir(parents=True, exist_ok=True)
            self._inodes[host.namespace] = ns.add(host.namespace)
            # Made in the bridge's namespace with the other end put straight into the host's: no link is ever
            # in the machine's own namespace, so nothing here can clash with another test's links.
            link = [
                "link",
                "add",
                host._port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.namespace,
            ]
            ns.ip(*link, namespace=self.network)
            ns.ip("link", "set", host._port, "master", "br0", "up", namespace=self.network)
            ns.ip("addr", "add", f"{host.address}/24", "dev", "eth0", namespace=host.namespace)
            ns.ip("link", "set", "eth0", "up", namespace=host.namespace)

    def run_together(
        self,
        commands: Sequence[tuple[Host, Sequence[str]]],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> list[subprocess.CompletedProcess]:
        """Run each ``(host, argv)`` at once (one launcher per node, as on a cluster) and wait for all; each
        result's ``stdout`` holds its output and error output together. After ``timeout`` seconds every command
        still running is killed with all it started, and ``subprocess.TimeoutExpired`` is raised with every
        command's output so far."""
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        started = []
        for host, argv in commands:
            log = logs / f"{host.name}-{next(_serial)}.log"
            with open(log, "wb") as out:
                started.append((host, log, host.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)))
        deadline = time.monotonic() + timeout
        expired = False
        for _, _, process in started:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                expired = True
                break
        if expired:
            for _, _, process in started:
                ns.kill_pids(ns.descendants(process.pid))
                process.wait()
        results = [
            subprocess.CompletedProcess(p.args, p.returncode, log.read_text(errors="replace"), "")
            for _, log, p in started
        ]
        if expired:
            joined = "".join(f"--- {h.name}: {r.stdout}" for (h, _, _), r in zip(started, results))
            raise subprocess.TimeoutExpired([h.name for h, _, _ in started], timeout, joined)
        return results

    def _reap(self) -> None:
        self._started = [p for p in self._started if p.poll() is None]

    def processes(self) -> dict[str, dict[int, str]]:
        """``{host name: {pid: command}}`` of every live process on the hosts (daemons included)."""
        return {h.name: h.pids() for h in self.hosts if h.namespace in self._inodes}

    def left_behind(self, grace: float = 2.0) -> dict[int, str]:
        """The processes other than daemons still on the hosts once ``grace`` seconds have passed for them to
        end (a run that just returned may still be reaping its workers)."""
        deadline = time.monotonic() + grace
        while True:
            self._reap()
            found = {
                pid: f"{name}: {command}"
                for name, pids in self.processes().items()
                for pid, command in pids.items()
                if pid not in self._daemons
            }
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def check(self, grace: float = 2.0) -> None:
        """After a test: raise :class:`LeftBehindError` naming any process it left on the hosts (daemons
        aside), once they are killed so that the next test starts clean, and any stratagem scratch entry left
        in a host's local folder (:meth:`scratch_left`), once removed."""
        found, scratch, problems = self.left_behind(grace), self.scratch_left(), []
        for _, path in self._scratch():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if scratch:
            problems.append(
                f"stratagem scratch in the hosts' temporary folders (now removed): {'; '.join(scratch)}"
            )
        if found:
            for _ in range(50):
                ns.kill_pids(found)
                time.sleep(0.05)
                if not self.left_behind(0):
                    break
            listed = "; ".join(f"{pid} ({what})" for pid, what in sorted(found.items()))
            problems.insert(0, f"the test left processes on the hosts (now killed): {listed}")
        if problems:
            raise LeftBehindError("; ".join(problems))

    def scratch_left(self) -> list[str]:
        """stratagem's scratch entries (``stratagem-*``) in the hosts' local folders: what a run left in a
        temporary folder (a killed process's are removed by the next run on the host; a finished run leaves
        none)."""
        return sorted(f"{host.name}: {path.name}" for host, path in self._scratch())

    def _scratch(self) -> list[tuple[Host, Path]]:
        return [
            (host, host.local / name)
            for host in self.hosts
            if host.local is not None and host.local.is_dir()
            for name in os.listdir(host.local)
            if name.startswith("stratagem")
        ]

    def leftovers(self) -> list[str]:
        """What of this set exists on the machine: its namespaces and every process in them."""
        alive = ns.processes(set(self._inodes.values())) if self._inodes else {}
        found = [f"namespace {name}" for name in ns.names(self.base + "-")]
        return found + [f"process {pid}: {command}" for pid, (_, command) in sorted(alive.items())]

    def close(self) -> list[str]:
        """End every process on the hosts, then remove the namespaces (and with them the links and the
        bridge). What could not be removed (empty when all went); a second call does nothing."""
        alive = ns.kill(set(self._inodes.values()), reap=self._reap) if self._inodes else {}
        left = [f"process {pid}: {command}" for pid, command in sorted(alive.items())]
        for name in [*(h.namespace for h in self.hosts), self.network]:
            try:
                ns.delete(name)
            except ns.NamespaceError as error:
                left.append(str(error))
        self._inodes.clear()
        self._daemons.clear()
        return left + [f"namespace {name}" for name in ns.names(self.base + "-")]


def _remove_orphans() -> None:
    """Remove the namespaces of hosts whose maker was killed before it could (its pid is gone)."""
    for name in ns.names(PREFIX):
        if ns.owner_alive(name, PREFIX):
            continue
        try:
            ns.kill({ns.inode(name)}, timeout=5.0)
            ns.delete(name)
        except (OSError, ns.NamespaceError):
            continue  # another process removed it meanwhile
