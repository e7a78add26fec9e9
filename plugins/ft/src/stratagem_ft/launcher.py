"""``replica_groups``: the replica groups of a fault-tolerant strategy, each launched and restarted on its own.

``stratagem run --launcher replica_groups --strategy "ft_ddp[num_replica_groups=2]" --devices 1 train.py``
(or ``Trainer(strategy=..., devices=1, launcher="replica_groups")``) starts a torchft lighthouse in this
process and the two groups, each in a process of its own running its workers under torch's elastic agent:
when a worker dies, its group alone is restarted (``max_restarts``) and heals from a live group, while the
others go on. With ``replica_id=N`` it starts that group only, and joins the lighthouse given by
``lighthouse=...`` or ``$TORCHFT_LIGHTHOUSE`` (one launch per group: on several hosts, under SLURM).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from stratagem import get_registry, hookimpl
from stratagem.errors import ConfigurationError, Preempted, WorkerFailedError
from stratagem.launchers import Launcher, LaunchJob
from stratagem_ft import _group_launch, _lighthouse
from stratagem_ft._config import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_ID_ENV
from stratagem_ft.strategy import FTStrategy

#: Where stratagem's ``stratagem run --strategy`` leaves the strategy's name for the workers.
STRATEGY_ENV = "STRATAGEM_STRATEGY"


class ReplicaGroupsLauncher(Launcher):
    """Launch the replica groups of ``ft_ddp``, ``ft_hsdp`` or ``diloco`` on this machine, each under torch's
    elastic agent in a process of its own, and a lighthouse for them unless one is given.

    :param poll_interval: seconds between looks at the groups' processes.
    """

    def __init__(self, poll_interval: float = 0.2) -> None:
        if (
            isinstance(poll_interval, bool)
            or not isinstance(poll_interval, (int, float))
            or poll_interval <= 0
        ):
            raise ConfigurationError(
                f"ReplicaGroupsLauncher(poll_interval={poll_interval!r}): give seconds > 0."
            )
        self.poll_interval = float(poll_interval)

    @hookimpl
    def launch_workers(self, job: LaunchJob) -> dict[int, Any]:
        strategy = strategy_of(job)
        config = strategy.config
        replica, total = config.replica_id, config.num_replica_groups or 1
        groups = list(range(total)) if replica is None else [replica]
        if len(groups) > 1 and job.max_nodes > 1:
            raise ConfigurationError(
                f"{strategy.label}: a replica group on several nodes needs a launch of its own per group: give "
                "each group's launches replica_id=N (and the same lighthouse)."
            )
        address = config.lighthouse_address()
        server = None
        if address is None:
            if replica is not None:
                raise ConfigurationError(
                    f"{strategy.label}(replica_id={replica}): this launch starts one group of {total}, which "
                    "must meet the others at a lighthouse: give lighthouse=http://HOST:PORT or "
                    f"${LIGHTHOUSE_ENV} (torchft_lighthouse --min_replicas 1 starts one)."
                )
            server = _lighthouse.start(config.heartbeat_timeout)
            address = server.address()
        else:
            _lighthouse.check_reachable(address, config.connect_timeout, strategy.label)
        try:
            with tempfile.TemporaryDirectory(prefix="stratagem-ft-") as scratch:
                outcomes = self._run(job, groups, total, address, Path(scratch))
        finally:
            if server is not None:
                server.shutdown()
        return _settle(outcomes)

    def _run(
        self, job: LaunchJob, groups: list[int], total: int, address: str, scratch: Path
    ) -> dict[int, Any]:
        children: dict[int, subprocess.Popen[str]] = {}
        readers = []
        with _passing_on(job.preemption_signals, children):
            for group in groups:
                env = {
                    **job.env,
                    REPLICA_ID_ENV: str(group),
                    NUM_REPLICA_GROUPS_ENV: str(total),
                    LIGHTHOUSE_ENV: address,
                    # torchft's Rust side logs every quorum at INFO; its warnings and errors are what a run needs.
                    "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
                }
                # The group's launch must not pick this launcher again, nor the strategy's name tell it to.
                env.pop("STRATAGEM_LAUNCHER", None)
                job_path, result_path = scratch / f"group-{group}.job", scratch / f"group-{group}.result"
                _group_launch.write_job(str(job_path), attrs.evolve(job, env=env))
                child = subprocess.Popen(
                    [sys.executable, "-m", "stratagem_ft._group_launch", str(job_path), str(result_path)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    bufsize=1,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
                children[group] = child
                readers.append(
                    _prefixing(child.stdout, f"[replica group {group}] " if len(groups) > 1 else "")
                )
            while any(child.poll() is None for child in children.values()):
                time.sleep(self.poll_interval)
        for reader in readers:
            reader.join(timeout=5)
        return {group: _outcome(scratch / f"group-{group}.result", children[group]) for group in groups}


def strategy_of(job: LaunchJob) -> FTStrategy:
    """The job's strategy, built from its name and options (a bad option is refused here, before anything
    starts); it must be one of stratagem-ft's."""
    name = getattr(job, "strategy", None)
    options = dict(getattr(job, "strategy_options", None) or {})
    if name is None and job.env.get(STRATEGY_ENV):
        raise ConfigurationError(
            f"The replica_groups launcher got the strategy {job.env[STRATEGY_ENV]!r} only as text; run it through "
            "`stratagem run --strategy ...`, a Trainer or an Engine given the name."
        )
    if name is None:
        raise ConfigurationError(
            "The replica_groups launcher starts the replica groups of a fault-tolerant strategy: give its name "
            "with options, e.g. strategy='ft_ddp[num_replica_groups=2]' (a Trainer or Engine), or `stratagem "
            "run --strategy 'ft_ddp[num_replica_groups=2]'` (a Strategy instance does not say its options)."
        )
    strategy = get_registry().get(name).create(**options)
    if not isinstance(strategy, FTStrategy):
        raise ConfigurationError(
            f"The replica_groups launcher starts the replica groups of ft_ddp, ft_hsdp and diloco; {name!r} has "
            "none: use the elastic launcher for it."
        )
    return strategy


def _die_with_parent() -> None:
    """In a group's launch process, before it runs: SIGTERM to it when this launcher dies, however it dies
    (SIGKILL included). Its agent then stops the group's workers as on a preemption; without it they would
    train on, orphaned."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _prefixing(stream: IO[str] | None, prefix: str) -> threading.Thread:
    """Copy a group's output to this process's, each line marked with its group."""

    def copy() -> None:
        assert stream is not None
        for line in stream:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()

    reader = threading.Thread(target=copy, name="stratagem-ft-output", daemon=True)
    reader.start()
    return reader


@contextlib.contextmanager
def _passing_on(signals: tuple[str, ...], children: dict[int, subprocess.Popen[str]]) -> Iterator[None]:
    """While the groups run, a preemption signal (or Ctrl-C) to this process goes on to every group's launch,
    whose agent passes it on to its workers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = dict.fromkeys([*signals, "SIGINT"])
    previous = {}

    def forward(number: int, frame: Any) -> None:
        for child in children.values():
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(number)

    for name in names:
        number = getattr(signal, name)
        previous[number] = signal.signal(number, forward)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _outcome(path: Path, child: subprocess.Popen[str]) -> tuple[Any, ...]:
    try:
        with open(path, "rb") as file:
            return pickle.load(file)
    except (OSError, EOFError, pickle.UnpicklingError):
        return (
            "failed",
            None,
            child.returncode,
            f"its launch ended with code {child.returncode} and said nothing",
        )


def _settle(outcomes: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
    """The job's result: the first group that finished; a group that failed for good is named on the way."""
    finished = [group for group, outcome in outcomes.items() if outcome[0] == "ok"]
    for group, outcome in outcomes.items():
        if outcome[0] == "failed" and finished:
            print(
                f"stratagem-ft: replica group {group} failed for good (its restarts used up) and replica group(s) "
                f"{', '.join(map(str, finished))} finished without it:\n{outcome[3]}",
                file=sys.stderr,
                flush=True,
            )
    if finished:
        return outcomes[finished[0]][1]
    exited = [outcome for outcome in outcomes.values() if outcome[0] == "exited"]
    if exited and all(outcome[1] == Preempted(message="", signal="").code for outcome in exited):
        raise Preempted(
            f"stratagem-ft: every replica group stopped for a preemption: {exited[0][2]}", signal=""
        )
    group, outcome = next((g, o) for g, o in outcomes.items() if o[0] != "ok")
    if outcome[0] == "exited":
        raise WorkerFailedError(None, outcome[1], f"replica group {group}: {outcome[2]}")
    raise WorkerFailedError(outcome[1], outcome[2], f"replica group {group}: {outcome[3]}")
