"""A failed actor, told as stratagem tells any worker's failure: its rank, and the worker's own traceback (or
how its process died); a peer that only lost its collective is not the cause when the real one arrives soon."""

from __future__ import annotations

import re
import time
from typing import Any

import attrs

from stratagem.errors import WorkerFailedError

#: How long reading a dead worker's error file on its node may take (a task starts a process there).
READ_TIMEOUT_S = 30.0


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


def _root_cause(first: WorkerFailedError, pending: dict[Any, int], places: list[Place]) -> WorkerFailedError:
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
            failure = _describe(rank, error, places[rank])
            if not is_lost_peer(failure.detail):
                return failure
    return first


def _describe(rank: int, error: BaseException, place: Place | None = None) -> WorkerFailedError:
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause if getattr(error, "cause", None) is not None else error
        return WorkerFailedError(rank, 1, _traceback_text(str(error)) or f"{type(cause).__name__}: {cause}")
    if isinstance(error, RayActorError):
        return _died(rank, error, place)
    return WorkerFailedError(rank, None, f"{type(error).__name__}: {error}")


@attrs.frozen
class Place:
    """Where a worker runs: its Ray node, that node's address, and the worker's error file there."""

    node_id: str
    address: str
    error_file: str = ""


def dead_nodes() -> dict[str, str]:
    """``{node id: "h1 (10.0.0.2) died: why"}`` of the cluster's dead nodes, as the GCS knows them."""
    import ray

    return {
        node["NodeID"]: (
            f"{node.get('NodeManagerHostname') or node['NodeManagerAddress']} ({node['NodeManagerAddress']}) "
            f"died: {node.get('DeathReasonMessage') or 'no reason given'}"
        )
        for node in ray.nodes()
        if not node.get("Alive")
    }


def _died(rank: int, error: BaseException, place: Place | None) -> WorkerFailedError:
    """An actor whose process is gone: its node died (named), or the process did; then what it recorded in
    its error file before it ended (the hang watchdog's report), read on its node."""
    text = str(error)
    node = place.node_id if place is not None else None
    if node is None:  # not placed yet: Ray's message has the node's id
        found = re.search(r"Node Id: ([0-9a-f]+)", text)
        node = found.group(1) if found else None
    dead = dead_nodes().get(node or "")
    if dead is not None:
        return WorkerFailedError(rank, None, f"its Ray node {dead}")
    recorded = _recorded(place) if place is not None and place.error_file else None
    if recorded:
        return WorkerFailedError(rank, 1, recorded)
    return WorkerFailedError(
        rank, None, "its process died (killed by a signal, or out of memory): " + text.splitlines()[0]
    )


def _take(path: str) -> str | None:
    """On the worker's node: the error file's text, removed."""
    import os

    try:
        with open(path) as file:
            text = file.read()
    except OSError:
        return None
    os.unlink(path)
    return text


def _recorded(place: Place) -> str | None:
    """What the worker recorded in its error file (read by a task on its node), or None."""
    import json

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_take).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(place.node_id, soft=False)
    )
    try:
        text = ray.get(task.remote(place.error_file), timeout=READ_TIMEOUT_S)
        data = json.loads(text) if text else None
    except Exception:  # the node went meanwhile, or the file is not JSON: nothing recorded to show
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, dict):
        return None
    return (message.get("extraInfo", {}).get("py_callstack") or message.get("message") or "").rstrip() or None
