"""Following a submitted job from the login node: rank 0's output as it is written, the job's end, and what
failed.

The files are the job's folder (on a file system the compute nodes share with the login node, as SLURM's own
``slurm-%j.out`` files are): ``attempt-N/rank-R.out|err`` per task, ``exit-R.json`` and ``error-R.json`` from
:mod:`stratagem_slurm._task`, and ``status`` from the batch script once it is done.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO

from stratagem.errors import WorkerFailedError
from stratagem.launchers import WorkerExit, describe_failure
from stratagem_slurm import _slurm
from stratagem_slurm._batch import BATCH_OUTPUT, STATUS_FILE, attempt_dir
from stratagem_slurm._task import error_file

#: How often the queue is asked about the job, at first and at most (the files are read more often; the
#: status file, not the queue, says when the job is done, so a long job need not ask often).
QUEUE_POLL_S = 2.0
QUEUE_POLL_MAX_S = 30.0


class _Tail:
    """New bytes of one file, copied to a stream."""

    def __init__(self, path: Path, stream: IO[str]) -> None:
        self.path, self.stream, self.offset = path, stream, 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return
        if data:
            self.offset += len(data)
            self.stream.write(data.decode(errors="replace"))
            self.stream.flush()


class Follower:
    """Streams rank 0's output of each attempt in turn, until the job is over."""

    def __init__(self, job_id: str, job_dir: Path, poll_s: float) -> None:
        self.job_id, self.job_dir, self.poll_s = job_id, job_dir, poll_s
        self.attempt = 0
        self._tails = self._tails_of(0)
        self._announced: str | None = None

    def _tails_of(self, attempt: int) -> list[_Tail]:
        directory = attempt_dir(self.job_dir, attempt)
        return [_Tail(directory / "rank-0.out", sys.stdout), _Tail(directory / "rank-0.err", sys.stderr)]

    def pump(self) -> None:
        for tail in self._tails:
            tail.pump()
        if attempt_dir(self.job_dir, self.attempt + 1).is_dir():
            self.attempt += 1
            self._tails = self._tails_of(self.attempt)
            self.pump()

    def _say(self, state: str, reason: str) -> None:
        # "None" is the reason of a job about to start.
        if state == "PENDING" and reason != "None" and self._announced != reason:
            print(f"stratagem: SLURM job {self.job_id} is pending ({reason}).", file=sys.stderr, flush=True)
        self._announced = reason if state == "PENDING" else state

    def wait(self) -> int | None:
        """Stream until the job is over; the batch script's final status (``None``: the job ended without
        writing one: cancelled, out of time, its node lost)."""
        status = self.job_dir / STATUS_FILE
        asked, interval = 0.0, QUEUE_POLL_S
        while not status.exists():
            self.pump()
            if time.monotonic() - asked >= interval:
                asked, interval = time.monotonic(), min(interval * 1.5, QUEUE_POLL_MAX_S)
                state, reason = _slurm.state(self.job_id)
                if state not in _slurm.ACTIVE_STATES and not status.exists():
                    self.pump()
                    return None
                self._say(state or "", reason)
            time.sleep(self.poll_s)
        self.pump()
        return int(status.read_text().strip() or 1)


def _failures(directory: Path) -> dict[int, WorkerExit]:
    """How each task that did not exit 0 ended, from the notes its ``_task`` wrote."""
    found = {}
    for path in directory.glob("exit-*.json"):
        rank = int(path.stem.split("-")[1])
        note = json.loads(path.read_text())
        if note["exitcode"] == 0:
            continue
        errors = error_file(directory, rank)
        found[rank] = WorkerExit(exitcode=note["exitcode"], timestamp=note["time"], error_file=str(errors))
    return found


def _tail(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])


def failure(job_id: str, job_dir: Path, attempts: int, status: int | None) -> WorkerFailedError:
    """The run's failure: the rank that failed first, with its traceback (or the end of its error output);
    else what SLURM says about the job."""
    directory = attempt_dir(job_dir, attempts - 1)
    found = _failures(directory)
    gave_up = f"\ngave up after {attempts - 1} restart(s)" if attempts > 1 else ""
    if found:
        error = describe_failure(found)
        detail = error.detail
        if detail.startswith("no traceback recorded") and error.rank is not None:
            said = _tail(directory / f"rank-{error.rank}.err")
            detail = f"its error output ended with:\n{said}" if said else "it wrote no error output"
        if status is None:  # the job was ended from outside: cancelled, out of time
            detail += f"\nSLURM job {job_id} ended: {_slurm.final_state(job_id)}"
        return WorkerFailedError(error.rank, error.exitcode, f"{detail}{gave_up}")
    ended = _slurm.final_state(job_id)
    batch = _tail(job_dir / BATCH_OUTPUT)
    return WorkerFailedError(
        None,
        status,
        f"SLURM job {job_id} ended ({ended}) with no worker failure on record; the batch output ended with:\n"
        f"{batch or '(nothing)'}{gave_up}",
    )


def attempts_made(job_dir: Path) -> int:
    return sum(1 for _ in job_dir.glob("attempt-*"))
