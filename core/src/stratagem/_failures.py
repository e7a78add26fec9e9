"""Reading how workers failed, from what torch's elastic agent collected: which failure started it all, and
what to tell the user about it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Mapping
from typing import Any

from stratagem.errors import WorkerFailedError

#: Beside the agent's error file, a worker notes when it failed (see :func:`root_failure`).
FAILURE_SUFFIX = ".stratagem.json"


def _failure_time(failure: Any) -> float | None:
    """When the worker recorded its exception (sub-second), or ``None`` if it recorded none."""
    path = getattr(failure, "error_file", "")
    if not path or not os.path.isfile(path + FAILURE_SUFFIX):
        return None
    try:
        return float(json.loads(open(path + FAILURE_SUFFIX).read())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that started it all.

    The agent orders failures by whole seconds, so a rank that failed because its peer vanished can tie with
    the peer. A worker that died without recording an exception (a signal other than the agent's SIGTERM,
    ``sys.exit(n)``) is a root cause: a lost peer shows up as an exception. Otherwise the earliest recorded
    exception is.
    """
    silent = [
        (f.timestamp, rank, f)
        for rank, f in failures.items()
        if _failure_time(f) is None and f.exitcode not in (0, -signal.SIGTERM)
    ]
    if silent:
        _, rank, failure = min(silent, key=lambda item: item[:2])
        return rank, failure
    timed = [(t, rank, f) for rank, f in failures.items() if (t := _failure_time(f)) is not None]
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
