"""A real SLURM cluster on this machine, for the tests: Debian's ``munged``, ``slurmctld`` and ``slurmd`` with a
configuration of its own (written here), its own ports, its state and spool folders under a temporary
directory, started as processes of this test session and stopped by their pids.

One node (this machine, on the loopback), or one node per host of a :class:`stratagem.contract.hosts.Hosts`:
``slurmctld`` on ``h0``, a ``slurmd`` on each host under the host's name and address, and one ``munged`` whose
socket (a file) every host reaches; client commands then run on ``h0``, the login node.

Clients reach it through ``SLURM_CONF`` (and munge through the socket that configuration names); nothing under
``/etc`` is read or changed, so another cluster on the same machine is left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

#: What a developer installs (as root) to run the SLURM tests.
INSTALL = "apt-get install -y slurmctld slurmd slurm-client munge"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
PARTITION = "debug"
#: How long the daemons may take to come up (they take a few seconds here).
START_TIMEOUT_S = 60.0


def _find(command: str) -> str | None:
    # The daemons live in /usr/sbin, which a user's PATH may lack.
    return shutil.which(command) or shutil.which(command, path="/usr/sbin:/sbin")


def why_unavailable() -> str | None:
    """Why the test cluster cannot start here (what to install or do), or ``None``."""
    missing = [c for c in (*DAEMONS, *CLIENTS) if _find(c) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} not found): as root, {INSTALL}"
    if os.geteuid() != 0:
        return "the test SLURM cluster's slurmd must run as root (it starts the tasks as their user): run as root"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """One controller and compute nodes of ``cpus`` CPUs in partition ``debug``: this machine alone, or each
    host of ``hosts`` (a :class:`stratagem.contract.hosts.Hosts`, the controller on the first)."""

    def __init__(self, root: Path, cpus: int, hosts: Any = None) -> None:
        self.root = root
        self.cpus = cpus
        self.hosts = list(hosts) if hosts is not None else None
        # Named for the loopback, where slurmd is told it runs (-N): a container's host name may not resolve.
        self.node = "localhost" if hosts is None else self.hosts[0].name
        self.nodes = {"localhost": "127.0.0.1"} if hosts is None else {h.name: h.address for h in self.hosts}
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._processes: dict[str, subprocess.Popen] = {}
        # Found once: a test may change PATH (to show what happens without SLURM) before this cluster's checks.
        self._commands = {c: _find(c) or c for c in (*DAEMONS, *CLIENTS)}
        # munged wants its socket's folder open to all, which pytest's temporary folders are not.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="stratagem-munge-"))
        self.socket_dir.chmod(0o755)
        self.socket = self.socket_dir / "munge.socket"

    # configuration -------------------------------------------------------------------------------------
    def _write_configuration(self) -> None:
        for sub in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.root / "plugstack.conf").write_text("")
        r = self.root
        lines = [
            "ClusterName=stratagemtest",
            f"SlurmctldHost={self.node}({self.nodes[self.node]})",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A requeued job may start again cred_expire + 1 s after its requeue (default 120 s).
            f"AuthInfo=socket={self.socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            # Per node (%n): a slurmd kills the one its pid file names, and each keeps its own job state.
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            # No cgroups: processes are tracked through their parents, tasks are not bound to CPUs.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            # A cancelled job's processes get SIGKILL this soon after SIGTERM.
            "KillWait=2",
            "InactiveLimit=0",
            # Pending jobs (a requeued one) are looked at every second, not every 30 to 60.
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            *(
                ["SlurmdTimeout=10"] if self.hosts else []
            ),  # a node that stops answering: DOWN in 10 s, not 300
            *(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN" for n, a in self.nodes.items()),
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    # running -------------------------------------------------------------------------------------------
    def _host(self, node: str) -> Any:
        return None if self.hosts is None else next(h for h in self.hosts if h.name == node)

    def _start(self, name: str, command: list[str], host: Any = None) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (held for the daemon's life)
        env, kwargs = {**os.environ, **self.env}, {"stdout": log, "stderr": subprocess.STDOUT}
        if host is None:
            self._processes[name] = subprocess.Popen(command, env=env, **kwargs)
        else:  # in the host's namespaces; the hosts' teardown ends it if this cluster's does not
            self._processes[name] = host.popen(command, env=self.env, daemon=True, **kwargs)
        log.close()

    def _alive_or_fail(self) -> None:
        for name, process in self._processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.logs()}")

    def _wait(self, what: str, ready: callable) -> None:  # type: ignore[valid-type]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            self._alive_or_fail()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the test SLURM cluster: {what} not ready in {START_TIMEOUT_S:.0f} s\n{self.logs()}"
                )
            time.sleep(0.2)

    def start(self) -> None:
        self._write_configuration()
        r = self.root
        self._start(
            "munged",
            [
                self._commands["munged"],
                "--foreground",
                f"--key-file={r / 'munge.key'}",
                f"--socket={self.socket}",
                f"--pid-file={r / 'munged.pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munged.seed'}",
            ],
        )
        self._wait("munged", lambda: self.socket.exists())
        controller = self._host(self.node)
        self._start("slurmctld", [self._commands["slurmctld"], "-D", "-f", str(self.conf)], controller)
        self._wait("slurmctld", lambda: self.run("scontrol", "ping").returncode == 0)
        for node in self.nodes:
            slurmd = [self._commands["slurmd"], "-D", "-f", str(self.conf), "-N", node]
            self._start("slurmd" if self.hosts is None else f"slurmd-{node}", slurmd, self._host(node))
        self._wait("the nodes", lambda: self.states() == {n: "idle" for n in self.nodes})
        for host in self.hosts or ():  # the daemons' helpers (slurmctld's slurmscriptd) are daemons too
            for pid in host.pids():
                host.add_daemon(pid)

    def states(self) -> dict[str, str]:
        """``{node: state}`` as sinfo says (``idle``, ``alloc``, ``down*``, ...)."""
        listed = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in listed.splitlines() if len(line.split()) == 2)

    def run(self, *command: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """A client command against this cluster (on the login node ``h0`` when there are hosts)."""
        argv = [self._commands.get(command[0], command[0]), *command[1:]]
        if self.hosts is not None:
            return self.hosts[0].run(argv, timeout=timeout, env=self.env)
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env}
        )

    def jobs(self) -> list[str]:
        """The jobs in the queue (pending, running or completing), as ``id state name``."""
        listed = self.run("squeue", "-h", "-o", "%i %T %j")
        return [line for line in listed.stdout.splitlines() if line.strip()]

    def wait_for_empty_queue(self, timeout: float = 30.0) -> list[str]:
        """Wait for the queue to empty (a finished job is listed as completing for a moment); what is left."""
        deadline = time.monotonic() + timeout
        while (left := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def job_processes(self) -> list[str]:
        """Live processes of this cluster's jobs and clients (every one carries its ``SLURM_CONF``), but for the
        daemons and this process: what a test left behind."""
        marker = f"SLURM_CONF={self.conf}".encode()
        daemons = {p.pid for p in self._processes.values()}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons | {os.getpid()}:
                continue
            try:
                state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
                environ = (entry / "environ").read_bytes().split(b"\0")
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError):
                continue
            # A zombie is dead already (this machine's init may be slow to reap); slurmctld's helper is a daemon.
            if state != "Z" and int(parent) not in daemons and marker in environ:
                found.append(f"{entry.name} {command.strip()}")
        return found

    def wait_for_job_processes(self, timeout: float = 15.0) -> list[str]:
        """Wait for the processes of ended jobs to go; those left. A step's slurmstepd outlives its job by up to
        ``KillWait`` while it makes sure that every process of the step is gone."""
        deadline = time.monotonic() + timeout
        while (left := self.job_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def logs(self) -> str:
        texts = []
        for path in sorted((self.root / "log").glob("*")):
            texts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(texts)

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons by pid (SIGTERM; SIGKILL if one lingers)."""
        if "slurmctld" in self._processes and self._processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", f"--user={os.getuid()}")
            self.wait_for_empty_queue(timeout=15.0)
        for name in sorted(self._processes, key=lambda n: -DAEMONS.index(n.split("-")[0])):
            process = self._processes.pop(name)
            if process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
