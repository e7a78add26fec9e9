"""Restarts of the worker group, seen from the workers: how many there were, what failed, what it cost.

torch's elastic agent tells each worker how many times the group restarted (``TORCHELASTIC_RESTART_COUNT``;
another launcher may say the same through ``STRATAGEM_RESTART_COUNT``), and SLURM how many times the job was
requeued (``SLURM_RESTART_COUNT``); a run's restarts are both together. stratagem's agent writes what failed
before each restart to the file named by ``STRATAGEM_RESTART_LOG`` (see :mod:`stratagem.launchers._elastic_agent`); beside it,
rank 0 keeps the newest step it finished, so that a restarted rank 0 can say how many steps were lost.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs

#: Set by stratagem's agent for every restart (a failure or a node joining); torch's counts failures only.
RESTART_COUNT_ENV = "STRATAGEM_RESTART_COUNT"
RESTART_COUNT_ENVS = (RESTART_COUNT_ENV, "TORCHELASTIC_RESTART_COUNT")
MAX_RESTARTS_ENVS = ("STRATAGEM_MAX_RESTARTS", "TORCHELASTIC_MAX_RESTARTS")
#: Set by SLURM in a job it requeued (absent in the job's first run).
SLURM_RESTART_ENV = "SLURM_RESTART_COUNT"
RESTART_LOG_ENV = "STRATAGEM_RESTART_LOG"
#: ``RANK: why`` of the failure that caused this restart, from a launcher that keeps no restart log.
LAST_FAILURE_ENV = "STRATAGEM_LAST_FAILURE"


def _first_int(names: tuple[str, ...]) -> int:
    for name in names:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                continue
    return 0


def restart_count() -> int:
    """How many times this worker group was restarted (0 in the first attempt), SLURM's requeues included."""
    return _first_int(RESTART_COUNT_ENVS) + slurm_requeues()


def slurm_requeues() -> int:
    """How many times SLURM requeued the job this process runs in (0 outside SLURM)."""
    return _first_int((SLURM_RESTART_ENV,))


def max_restarts() -> int:
    """The restarts the launcher allows this group (``torchrun --max-restarts`` counts too)."""
    return _first_int(MAX_RESTARTS_ENVS)


@attrs.frozen
class Restart:
    """One restart: which rank failed first and why, where training got to, and where it resumed."""

    attempt: int
    rank: int | None
    why: str
    reached_step: int | None
    resumed_step: int

    @property
    def steps_lost(self) -> int | None:
        return None if self.reached_step is None else max(0, self.reached_step - self.resumed_step)

    def describe(self, max_restarts: int) -> str:
        who = f"rank {self.rank} {self.why}" if self.rank is not None else self.why
        lost = "" if self.steps_lost is None else f"; {self.steps_lost} step(s) lost"
        total = f" of {max_restarts}" if max_restarts else ""
        return f"restart {self.attempt}{total}: {who}; resumed from step {self.resumed_step}{lost}"


def _log_path() -> Path | None:
    value = os.environ.get(RESTART_LOG_ENV)
    return Path(value) if value else None


def failures() -> list[dict[str, Any]]:
    """The failed attempts the agent wrote down on this node, oldest first."""
    path = _log_path()
    if path is None or not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash of the agent itself
    return entries


def latest_restart(resumed_step: int, preempted: dict[str, Any] | None = None) -> Restart:
    """This attempt's restart, as far as this node knows it. ``preempted``: the preemption record of the
    checkpoint it resumed from, the cause when no failure is on record (a requeued SLURM job)."""
    attempt = restart_count()
    entries = failures()
    entry = entries[-1] if entries else {}
    if not entry and LAST_FAILURE_ENV in os.environ:
        # A launcher without a restart log (Ray) hands the failure over in the environment.
        rank, _, why = os.environ[LAST_FAILURE_ENV].partition(":")
        entry = {"rank": int(rank) if rank.isdigit() else None, "why": why.strip()}
    reached = reached_step()
    if not entry and preempted is not None:
        by = " (SLURM requeued the job)" if slurm_requeues() else ""
        entry = {"why": f"preempted by {preempted.get('signal')} at step {preempted.get('step')}{by}"}
        reached = reached if reached is not None else preempted.get("step")
    return Restart(
        attempt=attempt,
        rank=entry.get("rank"),
        why=str(entry.get("why") or _unknown_failure()),
        reached_step=reached,
        resumed_step=resumed_step,
    )


def _unknown_failure() -> str:
    if _log_path() is None:
        return "a worker failed (the launcher keeps no record stratagem can read; see its log)"
    return "a worker on another node failed"


class ProgressNote:
    """Rank 0 keeps the newest step it finished beside the restart log (a few bytes rewritten per step)."""

    def __init__(self, enabled: bool) -> None:
        path = _log_path()
        self._fd = None
        if enabled and path is not None:
            self._fd = os.open(path.with_suffix(".step"), os.O_WRONLY | os.O_CREAT, 0o600)

    def note(self, step: int) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, f"{step:>20}\n".encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def reached_step() -> int | None:
    path = _log_path()
    if path is None:
        return None
    try:
        return int(path.with_suffix(".step").read_text().strip())
    except (OSError, ValueError):
        return None
