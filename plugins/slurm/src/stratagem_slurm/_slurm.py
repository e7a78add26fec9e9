"""SLURM's client commands, as the launcher uses them: is a controller reachable, what the partitions hold,
submit, ask after and cancel a job. Everything goes through the commands a login node has (``scontrol``,
``sinfo``, ``sbatch``, ``squeue``, ``scancel``), so no accounting database (``sacct``) is needed."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import time
from collections.abc import Sequence

import attrs

from stratagem.errors import ConfigurationError

COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
#: States in which a job still holds (or waits for) resources.
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "STOPPED"}
)
_TIMEOUT_S = 60.0


def run(*command: str, timeout: float = _TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)


def require_reachable() -> None:
    """Fail, saying what to install or set, unless the client commands exist and the controller answers."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise ConfigurationError(
            f"launcher='slurm' needs SLURM's client commands on PATH; {', '.join(missing)} not found. Run from a "
            "login node of a SLURM cluster, or install the clients (Debian/Ubuntu: apt-get install slurm-client "
            "munge, with the cluster's munge key) and set SLURM_CONF to the cluster's slurm.conf."
        )
    ping = run("scontrol", "ping")
    if ping.returncode != 0 or " is UP" not in ping.stdout:
        conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf (the default; SLURM_CONF is not set)")
        said = (ping.stdout.strip().splitlines() or ping.stderr.strip().splitlines() or ["no answer"])[0]
        raise ConfigurationError(
            f"launcher='slurm': no SLURM controller answers (`scontrol ping`: {said}). Check SLURM_CONF (now "
            f"{conf}) and that munged runs on this machine with the cluster's key."
        )


@attrs.frozen
class Partition:
    name: str
    default: bool
    state: str
    max_nodes: int | None
    #: CPUs of each node of the partition.
    node_cpus: tuple[int, ...]


def _fields(line: str) -> dict[str, str]:
    return dict(token.split("=", 1) for token in line.split() if "=" in token)


def partitions() -> dict[str, Partition]:
    listed = run("scontrol", "show", "partition", "-o")
    if listed.returncode != 0:
        raise ConfigurationError(
            f"launcher='slurm': `scontrol show partition` failed: {listed.stderr.strip()}"
        )
    found = {}
    for line in filter(str.strip, listed.stdout.splitlines()):
        fields = _fields(line)
        name = fields["PartitionName"]
        max_nodes = fields.get("MaxNodes", "UNLIMITED")
        found[name] = Partition(
            name=name,
            default=fields.get("Default") == "YES",
            state=fields.get("State", "UP"),
            max_nodes=int(max_nodes) if max_nodes.isdigit() else None,
            node_cpus=_node_cpus(name),
        )
    return found


def _node_cpus(partition: str) -> tuple[int, ...]:
    listed = run("sinfo", "-h", "-N", "-p", partition, "-o", "%N %c")
    cpus = {}
    for line in filter(str.strip, listed.stdout.splitlines()):
        node, count = line.split()
        cpus[node] = int(count.rstrip("+"))  # a node listed in several partitions shows once per partition
    return tuple(cpus.values())


def choose_partition(asked: str | None) -> Partition:
    """The partition to submit to: the one asked for (``partition=`` or ``SBATCH_PARTITION``) or the default."""
    known = partitions()
    if asked is None:
        defaults = [p for p in known.values() if p.default]
        if not defaults:
            raise ConfigurationError(
                f"launcher='slurm': the cluster has no default partition; name one with launcher_options="
                f"{{'partition': ...}} or SBATCH_PARTITION. Partitions: {', '.join(sorted(known)) or '(none)'}."
            )
        return defaults[0]
    if asked not in known:
        close = difflib.get_close_matches(asked, list(known), n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"Unknown SLURM partition {asked!r}.{hint} Partitions of this cluster: {', '.join(sorted(known))}."
        )
    partition = known[asked]
    if partition.state != "UP":
        raise ConfigurationError(
            f"SLURM partition {asked!r} is {partition.state}: a job there would not start. Choose another: "
            f"{', '.join(sorted(n for n, p in known.items() if p.state == 'UP')) or '(none is UP)'}."
        )
    return partition


def check_fits(partition: Partition, *, nodes: int, tasks_per_node: int, cpus_per_task: int) -> None:
    """Refuse a request the partition can never hold (it would wait in the queue for ever)."""
    need = tasks_per_node * cpus_per_task
    able = [cpus for cpus in partition.node_cpus if cpus >= need]
    what = f"{nodes} node(s) x {tasks_per_node} task(s) x {cpus_per_task} CPU(s) per task"
    if partition.max_nodes is not None and nodes > partition.max_nodes:
        raise ConfigurationError(
            f"{what}: partition {partition.name!r} allows at most {partition.max_nodes} node(s) per job."
        )
    if len(able) < nodes:
        sizes = ", ".join(str(c) for c in sorted(set(partition.node_cpus))) or "no"
        raise ConfigurationError(
            f"{what} need {need} CPUs on each of {nodes} node(s); partition {partition.name!r} has "
            f"{len(partition.node_cpus)} node(s) with {sizes} CPUs, {len(able)} of them large enough. Ask for "
            "fewer devices (or CPUs per task), fewer nodes, or another partition."
        )


def submit(arguments: Sequence[str], script: str) -> str:
    """``sbatch`` the script; the job's id."""
    done = run("sbatch", "--parsable", *arguments, script)
    if done.returncode != 0:
        raise ConfigurationError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def state(job_id: str) -> tuple[str | None, str]:
    """The job's state and reason while SLURM lists it in the queue, else ``(None, "")``."""
    listed = run("squeue", "-h", "-j", job_id, "-o", "%T %r")
    words = listed.stdout.split(maxsplit=1) if listed.returncode == 0 else []
    return (words[0], words[1].strip() if len(words) > 1 else "") if words else (None, "")


def final_state(job_id: str) -> str:
    """What the controller still knows of a job that ended (``JobState``, ``Reason``, ``ExitCode``)."""
    shown = run("scontrol", "show", "job", "-o", job_id)
    fields = _fields(shown.stdout) if shown.returncode == 0 else {}
    if not fields:
        return "its record is gone"
    return ", ".join(f"{k} {fields[k]}" for k in ("JobState", "Reason", "ExitCode") if k in fields)


def wait_until_gone(job_id: str, timeout: float = 60.0) -> bool:
    """Wait for the job to leave the queue (a finished job completes for a moment); whether it did."""
    deadline = time.monotonic() + timeout
    while (current := state(job_id)[0]) in ACTIVE_STATES:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2 if current == "COMPLETING" else 0.5)
    return True


def cancel(job_id: str) -> bool:
    """Cancel the job and wait for it to leave the queue; whether it did."""
    run("scancel", job_id)
    return wait_until_gone(job_id)
