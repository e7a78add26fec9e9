"""How a worker's failure is recorded and read back: the worker writes its uncaught exception to the file its
launcher named (:func:`record_exception`, in torch's elastic error-file format); the launcher reads what each
worker left (:class:`WorkerExit`, or torch's own records) and tells the user which failure started it all
(:func:`describe_failure`). The elastic launcher, stratagem-slurm and any third-party launcher share it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from stratagem.errors import WorkerFailedError

#: The environment variable naming the file where a worker records its uncaught exception: a launcher gives
#: each worker a file of its own; stratagem, in the worker, writes there (:func:`record_exception`). The name is
#: torch's elastic agent's, so that workers started by torchrun record their failures the same way.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: Beside the agent's error file, a worker notes when it failed (see :func:`root_failure`).
FAILURE_SUFFIX = ".stratagem.json"
#: A worker whose collective lost its peer waits this long before it exits, so that the peer's own failure (the
#: cause) reaches the launcher first; a launcher that sees a lost peer first may wait as long for the cause.
LOST_PEER_GRACE_S = 3.0

#: What a collective says when the peer it waits for is gone (gloo's TCP transport, c10d's store, NCCL).
_LOST_PEER_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
    "NCCL communicator was aborted",
    "DistNetworkError",
)


def is_lost_peer(text: str) -> bool:
    """Whether an exception's text (type, message or traceback) is a collective losing its peer.

    Such an exception is a consequence, not a cause: the peer failed first, though its exception may be noted
    later (a ``finally`` that destroys the process group runs before the exception reaches the worker's
    top level, and it is what breaks the waiting peers' connections).
    """
    return any(sign in text for sign in _LOST_PEER_SIGNS)


def _noted(failure: Any) -> dict[str, Any] | None:
    path = getattr(failure, "error_file", "")
    if not path or not os.path.isfile(path + FAILURE_SUFFIX):
        return None
    try:
        data = json.loads(Path(path + FAILURE_SUFFIX).read_text())
        data["time"] = float(data["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data


def _failure_time(failure: Any) -> float | None:
    """When the worker recorded its exception (sub-second), or ``None`` if it recorded none."""
    noted = _noted(failure)
    return None if noted is None else noted["time"]


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that started it all.

    The agent orders failures by whole seconds, so a rank that failed because its peer vanished can tie with
    the peer. A worker that died without recording an exception (a signal other than the agent's SIGTERM,
    ``sys.exit(n)``) is a root cause: a lost peer shows up as an exception. Otherwise the earliest recorded
    exception that is not a collective losing its peer (:func:`is_lost_peer`) is, and failing that the earliest.
    """
    silent = [
        (f.timestamp, rank, f)
        for rank, f in failures.items()
        if _failure_time(f) is None and f.exitcode not in (0, -signal.SIGTERM)
    ]
    if silent:
        _, rank, failure = min(silent, key=lambda item: item[:2])
        return rank, failure
    noted = {rank: data for rank, f in failures.items() if (data := _noted(f)) is not None}
    causes = [
        (data["time"], rank, failures[rank]) for rank, data in noted.items() if not data.get("lost_peer")
    ]
    if causes:
        _, rank, failure = min(causes, key=lambda item: item[:2])
        return rank, failure
    timed = [(data["time"], rank, failures[rank]) for rank, data in noted.items()]
    if timed:
        _, rank, failure = min(timed, key=lambda item: item[:2])
        return rank, failure
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank]


def describe_failure(failures: Mapping[int, Any]) -> WorkerFailedError:
    """The run's failure as stratagem reports it: the rank whose failure started it all, with its traceback (or
    the signal that killed it).

    :param failures: by global rank, how each worker that did not exit 0 ended: a :class:`WorkerExit`, or
        anything with the same attributes (torch's elastic ``ProcessFailure`` has them). A worker stopped by
        the launcher with SIGTERM after another failed is not taken for the cause.
    """
    rank, failure = root_failure(failures)
    exitcode = failure.exitcode
    # A worker that recorded its exception failed because of it, even if its exit then ended by a signal.
    if exitcode is not None and exitcode < 0 and _failure_time(failure) is None:
        with contextlib.suppress(ValueError):
            detail = f"killed by signal {signal.Signals(-exitcode).name}"
            return WorkerFailedError(rank, exitcode, detail)
    message = failure.message if isinstance(failure.message, str) else ""
    if "To enable traceback" in message:  # the agent's placeholder when no error file was written
        message = ""
    data = failure.error_file_data or {}
    stack = ""
    if isinstance(data.get("message"), dict):
        stack = data["message"].get("extraInfo", {}).get("py_callstack", "")
    detail = (stack or message or "no traceback recorded (see the worker's output above)").rstrip()
    return WorkerFailedError(rank, exitcode, detail)


@attrs.frozen(kw_only=True)
class WorkerExit:
    """How one worker process ended, as its launcher saw it: what :func:`describe_failure` reads.

    :param exitcode: the exit status; negative when a signal killed the process (``-9``); ``None`` if unknown.
    :param timestamp: when it ended (``time.time()``), or when the launcher noticed.
    :param error_file: the file the worker was given in :data:`ERROR_FILE_ENV` (``""`` if none), where
        stratagem recorded its uncaught exception.
    :param message: what the launcher knows about the end, shown when the worker recorded nothing.
    """

    exitcode: int | None
    timestamp: float
    error_file: str = ""
    message: str = ""

    @property
    def error_file_data(self) -> dict[str, Any]:
        """What the worker recorded in its error file (``{}`` when it recorded nothing)."""
        try:
            data = json.loads(Path(self.error_file).read_text()) if self.error_file else {}
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def _note_failure_time(error: BaseException | None = None) -> None:
    text = "" if error is None else "".join(traceback.format_exception_only(type(error), error))
    consequence = is_lost_peer(text)
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        with contextlib.suppress(OSError):
            with open(path + FAILURE_SUFFIX, "w") as file:
                json.dump({"time": time.time(), "lost_peer": consequence}, file)
    if consequence:
        time.sleep(LOST_PEER_GRACE_S)


def record_exception(kind: type[BaseException], value: BaseException, tb: Any) -> bool:
    """In a worker: record an exception where its launcher reads it (the file named by :data:`ERROR_FILE_ENV`).

    Returns ``False`` when there is nowhere to record it. A collective that lost its peer is recorded as such,
    and the call then waits :data:`LOST_PEER_GRACE_S` so that the peer's own failure reaches the launcher
    first. Scripts need not call it: stratagem records an uncaught exception in every worker. A launcher that
    runs a function job in a process of its own calls it when the function raises, then exits non-zero.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    data = {
        "message": {
            "message": f"{kind.__name__}: {value}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:
        return False
    _note_failure_time(value)
    return True
