"""The Ray cluster a run uses: the one it is given, or a local one started for the run and removed after it
(its processes, and its session folder of logs and sockets under Ray's temporary directory, which Ray keeps)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path

from stratagem.errors import ConfigurationError


class LocalCluster:
    """A cluster of this machine alone, started for one run."""

    def __init__(self, session_dir: str | None) -> None:
        self.session_dir = Path(session_dir) if session_dir else None

    def stop(self) -> None:
        import ray

        ray.shutdown()
        if self.session_dir is not None:
            _remove_session(self.session_dir)


def _remove_session(session: Path) -> None:
    # Every ray.init of a new cluster adds a session folder (`<temp>/ray/session_<time>_<pid>`) and Ray removes
    # none; a run would leave one in the temporary directory each time. The workers' output reached the driver.
    shutil.rmtree(session, ignore_errors=True)
    latest = session.parent / "session_latest"
    with contextlib.suppress(OSError):
        if latest.is_symlink() and Path(os.readlink(latest)).name == session.name:
            latest.unlink()
    with contextlib.suppress(OSError):
        session.parent.rmdir()  # only if nothing else is in it (another cluster's sessions)


def connect(address: str | None, world: int, per_worker: dict[str, float]) -> LocalCluster | None:
    """Join the cluster to use; the local cluster if one was started here (and must be stopped)."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return None
    if address:
        check_reachable(address)
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return None
    cpus = int(max(world * per_worker.get("CPU", 0), os.cpu_count() or 1))
    # A cluster of this machine alone, on the loopback address.
    context = ray.init(
        address="local",  # a new cluster, even if another runs on this machine
        num_cpus=cpus,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        _node_ip_address="127.0.0.1",
    )
    return LocalCluster(context.address_info.get("session_dir"))


def resources_text() -> str:
    import ray

    total = ray.cluster_resources()
    return (
        ", ".join(f"{value:g} {key}" for key, value in sorted(total.items()) if key in ("CPU", "GPU"))
        or "nothing"
    )


def available_text(bundle: dict[str, float]) -> str:
    """The cluster's free amounts of the resources ``bundle`` asks for."""
    import ray

    return _amounts(ray.available_resources(), [k for k, v in bundle.items() if v > 0]) or "nothing"


def check_resources(world: int, per_worker: dict[str, float]) -> None:
    import ray

    total = ray.cluster_resources()
    for key, each in per_worker.items():
        need = world * each
        if total.get(key, 0.0) < need:
            raise ConfigurationError(
                f"{world} worker(s) with {each:g} {key} each need {need:g} {key}; the Ray cluster has "
                f"{resources_text()}. Ask for fewer devices, or give the cluster more."
            )


def _amounts(resources: dict[str, float], keys: list[str]) -> str:
    return ", ".join(f"{resources.get(key, 0.0):g} {key}" for key in keys)


def _largest(nodes: list[dict[str, float]], asked: dict[str, float]) -> dict[str, float]:
    """The node nearest to holding ``asked``: the largest share of it in its scarcest resource."""
    return max(
        nodes, key=lambda node: (min(node.get(k, 0.0) / v for k, v in asked.items()), sum(node.values()))
    )


def alive_nodes() -> list[dict[str, float]]:
    """Each alive node's total resources."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def placement_text(bundle: dict[str, float], count: int, per_node: int) -> str:
    """A placement group of ``count`` bundles of ``per_node`` workers each, in words."""
    asked = {k: v for k, v in bundle.items() if v > 0}
    where = "one Ray node" if count == 1 else f"each of {count} Ray nodes"
    return f"{per_node} worker(s) with {_amounts(asked, list(asked))} in all on {where}"


def check_placement(bundle: dict[str, float], count: int, per_node: int) -> None:
    """Refuse at once a placement that no alive nodes can hold, however long it waited: ``count`` bundles
    (each a node's ``per_node`` workers) on as many distinct nodes. Ray keeps such a group pending, and the
    cluster-wide totals (:func:`check_resources`) do not show that no node is large enough."""
    asked = {k: v for k, v in bundle.items() if v > 0}
    nodes = alive_nodes()
    holding = [node for node in nodes if all(node.get(k, 0.0) >= v for k, v in asked.items())]
    if len(holding) >= count or not asked:
        return
    largest = _largest(nodes, asked) if nodes else {}
    room = min(int(largest.get(k, 0.0) // (v / per_node)) for k, v in asked.items())
    if len(holding) < 1:
        advice = (
            "Ask for fewer workers per node (spread them over nodes with num_nodes), or give a node more."
        )
    else:
        advice = f"Ask for at most {len(holding)} node(s), or add nodes that large."
    raise ConfigurationError(
        f"Ray cannot place {placement_text(bundle, count, per_node)}: {len(holding)} of the cluster's "
        f"{len(nodes)} alive node(s) can hold that, and the largest has {_amounts(largest, list(asked))} "
        f"(room for {room} worker(s)). {advice}"
    )


def check_reachable(address: str) -> None:
    """Fail at once, with the address, when nothing listens there (Ray itself would retry for a long time)."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            return
    except (OSError, ValueError) as error:
        raise ConfigurationError(
            f"Ray cluster at {address!r} cannot be reached ({error}). Start one with `ray start --head`, "
            "set RAY_ADDRESS to a running cluster's head, or leave address unset to start a local cluster."
        ) from None
