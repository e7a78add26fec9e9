"""A failed actor, told as stratagem tells any worker's failure: its rank, and the worker's own traceback (or
how its process died); a peer that only lost its collective is not the cause when the real one arrives soon."""

from __future__ import annotations

import re
import time
from typing import Any

from stratagem.errors import WorkerFailedError


def _traceback_text(text: str) -> str:
    """The worker's traceback from a Ray task error's message.

    Ray replaces the ``Traceback (most recent call last):`` header with the actor call's title, colours it,
    and keeps the frames (without Ray's own) and the exception line; give it back in Python's form.
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    start = text.find("Traceback (most recent call last)")
    if start >= 0:
        return text[start:].rstrip()
    lines = text.strip().splitlines()
    if len(lines) < 2:
        return ""
    frames = [line for line in lines[1:] if line.strip() and set(line.strip()) != {"^"}]
    return f"Traceback (most recent call last), in {lines[0].strip()}:\n" + "\n".join(frames)


def _root_cause(first: WorkerFailedError, pending: dict[Any, int]) -> WorkerFailedError:
    """The failure to report: ``first``, unless it is a collective that lost its peer and the peer's own
    failure arrives within the grace period (the peer's ``finally`` can break the collective before its
    exception leaves the actor)."""
    import ray

    from stratagem.launchers import LOST_PEER_GRACE_S, is_lost_peer

    if not is_lost_peer(first.detail):
        return first
    deadline = time.monotonic() + LOST_PEER_GRACE_S
    while pending and (left := deadline - time.monotonic()) > 0:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        if not done:
            break
        rank = pending.pop(done[0])
        try:
            ray.get(done[0])
        except Exception as error:
            failure = _describe(rank, error)
            if not is_lost_peer(failure.detail):
                return failure
    return first


def _describe(rank: int, error: BaseException) -> WorkerFailedError:
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause if getattr(error, "cause", None) is not None else error
        return WorkerFailedError(rank, 1, _traceback_text(str(error)) or f"{type(cause).__name__}: {cause}")
    if isinstance(error, RayActorError):
        return WorkerFailedError(
            rank,
            None,
            "its process died (killed by a signal, or out of memory): " + str(error).splitlines()[0],
        )
    return WorkerFailedError(rank, None, f"{type(error).__name__}: {error}")
