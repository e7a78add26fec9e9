"""``ray``: the workers of a run as Ray actors, one per device, in a placement group.

Why actors and not Ray Train's ``TorchTrainer``: stratagem's strategies set up ``torch.distributed`` themselves
from the rank environment (and own checkpointing and resuming through the Trainer), while ``TorchTrainer``
initialises the process group in its own backend and hands results back through ``ray.train.report``. With
plain actors in a placement group (Ray's own scheduling: one bundle per node holding its workers, the
bundles on different nodes for a multi-node run), the worker sees exactly what torchrun would give it, rank 0's return value comes back as it
is, and a failure is a Ray error of one actor that names its rank.

A run: connect to the cluster (``address``, else ``RAY_ADDRESS``, else a local cluster started here and shut
down afterwards), check that it has the resources, reserve a placement group, start one actor per worker,
give each the rank environment (rank 0's node address and a free port there as the master), and run the
script (``runpy``, as ``__main__``) or the function in every actor. The driver waits for the first actor to
fail or for all to finish; a failure ends every actor of the attempt and, while ``max_failures`` allows,
starts the group again with ``STRATAGEM_RESTART_COUNT`` raised, so that the Trainer resumes from its newest
checkpoint. Actors' output reaches the driver through Ray, each line led by the actor's rank.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

from stratagem.errors import ConfigurationError, WorkerFailedError
from stratagem.hookspecs import hookimpl
from stratagem.launchers import ERROR_FILE_ENV, Launcher, LaunchJob
from stratagem_ray import _cluster
from stratagem_ray._failures import Place, _describe, _root_cause, dead_nodes
from stratagem_ray._worker import _Worker

#: How long a placement group that the nodes could hold may wait for resources in use before the run is refused.
PLACEMENT_TIMEOUT_S = 60.0
#: How long the driver waits at the end for the workers' last output lines to arrive.
LOG_FLUSH_S = 1.5


class RayLauncher(Launcher):
    """Run the workers on Ray.

    :param address: the Ray cluster (``"host:port"`` of its head, or ``"auto"``); default ``RAY_ADDRESS``, else
        a local cluster started for the run and stopped after it.
    :param num_workers: workers in all (default: ``devices x num_nodes`` of the Trainer or Engine).
    :param resources_per_worker: Ray resources each worker reserves (default ``{"CPU": 1}``, plus ``{"GPU": 1}``
        on CUDA).
    :param max_failures: restarts of the worker group after a failure (default: the Trainer's
        ``max_restarts``).
    :param placement_timeout: seconds to wait for the workers' resources while other work holds them (a request
        that no node could hold is refused at once).
    """

    def __init__(
        self,
        address: str | None = None,
        num_workers: int | None = None,
        resources_per_worker: dict[str, float] | None = None,
        max_failures: int | None = None,
        placement_timeout: float = PLACEMENT_TIMEOUT_S,
    ) -> None:
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
            raise ConfigurationError(f"RayLauncher(num_workers={num_workers!r}): give a positive integer.")
        if max_failures is not None and (not isinstance(max_failures, int) or max_failures < 0):
            raise ConfigurationError(
                f"RayLauncher(max_failures={max_failures!r}): give 0 or a positive integer."
            )
        if (
            isinstance(placement_timeout, bool)
            or not isinstance(placement_timeout, (int, float))
            or not (placement_timeout > 0)
        ):
            raise ConfigurationError(
                f"RayLauncher(placement_timeout={placement_timeout!r}): give a positive number of seconds."
            )
        self.address = address
        self.num_workers = num_workers
        self.resources_per_worker = dict(resources_per_worker) if resources_per_worker else None
        self.max_failures = max_failures
        self.placement_timeout = float(placement_timeout)

    # the hook --------------------------------------------------------------------------------------------
    @hookimpl
    def launch_workers(self, job: LaunchJob) -> dict[int, Any]:

        world = self.num_workers or job.nproc_per_node * job.max_nodes
        per_worker = self.resources_per_worker or (
            {"CPU": 1.0, "GPU": 1.0} if job.accelerator == "cuda" else {"CPU": 1.0}
        )
        local = _cluster.connect(self.address, world, per_worker)
        try:
            _cluster.check_resources(world, per_worker)
            return self._run(job, world, per_worker)
        finally:
            if local is not None:
                local.stop()

    # running ---------------------------------------------------------------------------------------------
    def _run(self, job: LaunchJob, world: int, per_worker: dict[str, float]) -> dict[int, Any]:
        from ray.util.placement_group import placement_group, remove_placement_group

        per_node = _workers_per_node(job, world)
        spread = per_node < world
        # One bundle per node, holding that node's workers; STRICT_SPREAD puts each bundle on its own Ray node.
        bundle = {key: value * per_node for key, value in per_worker.items()}
        _cluster.check_placement(bundle, world // per_node, per_node)
        group = placement_group(
            [bundle] * (world // per_node), strategy="STRICT_SPREAD" if spread else "PACK"
        )
        placed = False
        try:
            if not _wait(group.ready(), self.placement_timeout):
                raise ConfigurationError(
                    f"Ray could not place {_cluster.placement_text(bundle, world // per_node, per_node)} within "
                    f"{self.placement_timeout:g} s: its nodes can hold that, but other work holds the resources "
                    f"(free now: {_cluster.available_text(bundle)} of the cluster's {_cluster.resources_text()}). "
                    "Wait for it to end, or give RayLauncher(placement_timeout=...) more seconds."
                )
            placed = True
            max_failures = job.max_restarts if self.max_failures is None else self.max_failures
            last: WorkerFailedError | None = None
            for attempt in range(max_failures + 1):
                failure = self._attempt(job, world, per_node, per_worker, group, attempt, max_failures, last)
                if isinstance(failure, dict):
                    return failure
                last = failure
                if attempt < max_failures:
                    print(
                        f"stratagem: rank {failure.rank} {failure.detail.strip().splitlines()[-1]}; restarting the "
                        f"workers ({attempt + 1} of {max_failures} restarts).",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                if max_failures:
                    failure = WorkerFailedError(
                        failure.rank,
                        failure.exitcode,
                        f"{failure.detail}\ngave up after {max_failures} restart(s)",
                    )
                raise failure
            raise AssertionError("unreachable")
        finally:
            if placed:
                # Ray's log monitor forwards the workers' output from their log files every so often: give it
                # the time to send the last lines before this driver goes.
                time.sleep(LOG_FLUSH_S)
            remove_placement_group(group)

    def _attempt(
        self,
        job: LaunchJob,
        world: int,
        per_node: int,
        per_worker: dict[str, float],
        group: Any,
        attempt: int,
        max_failures: int,
        last: WorkerFailedError | None,
    ) -> dict[int, Any] | WorkerFailedError:
        """One start of the whole group: every rank's result, or the first failure."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        worker_class = ray.remote(_Worker)
        bundles = _bundles_in_rank_order(group, world // per_node)
        actors = [
            worker_class.options(
                num_cpus=per_worker.get("CPU", 0),
                num_gpus=per_worker.get("GPU", 0),
                resources={k: v for k, v in per_worker.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=bundles[rank // per_node]
                ),
                # The job's environment from the start of the worker process: some of it is read only then
                # (glibc's malloc settings, OMP_NUM_THREADS), so the workers run as the elastic launcher's do.
                runtime_env={"env_vars": {k: str(v) for k, v in job.env.items()}},
            ).remote(rank)
            for rank in range(world)
        ]
        try:
            places = self._place(actors)
            if isinstance(places, WorkerFailedError):
                return places
            master_addr = places[0].address
            master_port = ray.get(actors[0].free_port.remote(), timeout=self.placement_timeout)
            nodes = list(dict.fromkeys(place.node_id for place in places))
            local_ranks: dict[str, int] = {}
            pending = {}
            for rank, (actor, place) in enumerate(zip(actors, places)):
                node = place.node_id
                local = local_ranks.get(node, 0)
                local_ranks[node] = local + 1
                env = {
                    **job.env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(sum(1 for p in places if p.node_id == node)),
                    "GROUP_RANK": str(nodes.index(node)),
                    "NODE_RANK": str(nodes.index(node)),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "STRATAGEM_WORKER": "1",
                    "STRATAGEM_NODE_ID": node,
                    "STRATAGEM_RESTART_COUNT": str(attempt),
                    "STRATAGEM_MAX_RESTARTS": str(max_failures),
                    ERROR_FILE_ENV: place.error_file,
                }
                if last is not None:
                    env["STRATAGEM_LAST_FAILURE"] = f"{last.rank}: {last.detail.strip().splitlines()[-1]}"
                ref = actor.run.remote(
                    env, job.kind, list(job.command), job.function, tuple(job.args), os.getcwd()
                )
                pending[ref] = rank
            results: dict[int, Any] = {}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                ref = done[0]
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as error:  # the first failure ends the attempt: its peers would only wait
                    return _root_cause(_describe(rank, error, places[rank]), pending, places)
            return results
        finally:
            for actor in actors:
                ray.kill(actor, no_restart=True)

    def _place(self, actors: list[Any]) -> list[Place] | WorkerFailedError:
        """Where each actor started, once all have (within ``placement_timeout``); or the failure of the first
        that could not start: its node died (a restart after a node was lost), or none was found for it."""
        import ray

        run = uuid.uuid4().hex[:12]
        asked = {actor.where.remote(run): rank for rank, actor in enumerate(actors)}
        places: dict[int, Place] = {}
        deadline = time.monotonic() + self.placement_timeout
        while asked:
            done, _ = ray.wait(list(asked), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                dead = "; ".join(dead_nodes().values()) or "none"
                return WorkerFailedError(
                    min(asked.values()),
                    None,
                    f"no Ray node took this worker within {self.placement_timeout:g} s (placement_timeout); the "
                    f"cluster's dead nodes: {dead}",
                )
            rank = asked.pop(done[0])
            try:
                places[rank] = Place(*ray.get(done[0]))
            except Exception as error:  # its node died before it started
                return _describe(rank, error)
        return [places[rank] for rank in range(len(actors))]


def _workers_per_node(job: LaunchJob, world: int) -> int:
    """How many workers share a node: ``devices`` on a multi-node run (ranks ``n * devices ...`` on node n, as
    under torchrun), all of them otherwise (or when ``num_workers`` does not split into the nodes)."""
    nodes = job.max_nodes
    if nodes > 1 and world == nodes * job.nproc_per_node:
        return job.nproc_per_node
    return world


def _bundles_in_rank_order(group: Any, count: int) -> list[int]:
    """The placement group's bundles by node rank: the one on the driver's node first, where it has one.
    Rank 0 holds the workers' store (``MASTER_ADDR``): on the driver's node it lives as long as the run does,
    and the others' watchdog can name a rank whose node is lost (with the store on the lost node, every rank
    waits on it until the collectives time out, naming nobody)."""
    import ray
    from ray.util import placement_group_table

    here = ray.get_runtime_context().get_node_id()
    nodes = placement_group_table(group).get("bundles_to_node_id") or {}
    return sorted(range(count), key=lambda bundle: nodes.get(bundle, nodes.get(str(bundle))) != here)


def _wait(ref: Any, timeout: float) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)
