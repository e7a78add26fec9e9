"""Reading how workers failed, from what torch's elastic agent collected: which failure started it all, and
what to tell the user about it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stratagem.errors import WorkerFailedError

#: Beside the agent's error file, a worker notes when it failed (see :func:`root_failure`).
FAILURE_SUFFIX = ".stratagem.json"

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


def lost_peer(text: str) -> bool:
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
    exception that is not a collective losing its peer (:func:`lost_peer`) is, and failing that the earliest.
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


def describe(failures: Mapping[int, Any]) -> WorkerFailedError:
    """The run's failure as stratagem reports it: the root failure's rank and its traceback or signal."""
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
