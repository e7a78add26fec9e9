"""Process-group set-up and collectives over ``torch.distributed``, shared by every multi-process strategy."""

from __future__ import annotations

import datetime
import itertools
from typing import Any

import torch
import torch.distributed as dist

from stratagem.errors import ConfigurationError
from stratagem.hookspecs import hookimpl
from stratagem.launchers.cluster import ClusterEnvironment
from stratagem.strategies.base import Strategy, _check_op

#: At exit, how long C++ threads get to drop what they still hold before the interpreter is torn down.
EXIT_QUIESCE_S = 0.2
_quiesce_registered = False


def _quiesce_at_exit() -> None:
    """Register, once per process, an exit handler that ends distributed work while Python is fully alive.

    A process group's C++ threads (gloo's workers) can still hold the last reference to a tensor that Python
    created when the main thread reaches interpreter shutdown; releasing it needs the interpreter, and a thread
    that asks for it during finalization is ended mid-way, which aborts the process ("terminate called without
    an active exception", SIGABRT) after a run that finished. The handler runs before finalization: it
    destroys a group the script left alive, collects garbage (dropping Python's side of such tensors), and
    gives the threads a moment to let go. Then it freezes what is left (:func:`gc.freeze`): objects that are
    still alive are freed by the interpreter's teardown as their references go, but its collections no longer
    walk the whole of torch's object graph again and again, which took most of a second of each process's exit
    (a preempted worker's among them; the launcher does the same, :func:`stratagem.launchers._elastic_agent.run_agent`).
    """
    global _quiesce_registered
    if _quiesce_registered:
        return
    import atexit

    atexit.register(_quiesce)
    _quiesce_registered = True


def _quiesce() -> None:
    import gc
    import time

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # exiting anyway; a peer may be gone
            pass
    gc.collect()
    time.sleep(EXIT_QUIESCE_S)
    gc.freeze()


#: How many process groups this process has formed through setup_environment (see there).
_GROUPS_FORMED = itertools.count()

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchDistributedStrategy(Strategy):
    """A strategy over one ``torch.distributed`` process group spanning every rank.

    It joins (or reuses) the default process group from the ``cluster`` object, implements the collectives,
    and destroys the group on teardown. On its own it trains like ``single_device`` on each rank, without
    synchronising gradients: subclasses wrap the model (DDP, FSDP, ...).

    :param process_group_backend: ``gloo`` or ``nccl``; default: the cluster's (``nccl`` on CUDA, else ``gloo``).
    :param timeout: the process-group timeout (a ``timedelta`` or seconds); default: the cluster's.
    """

    def __init__(
        self,
        *,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        super().__init__()
        if process_group_backend not in (None, "gloo", "nccl", "mpi", "cpu:gloo,cuda:nccl"):
            raise ConfigurationError(
                f"process_group_backend={process_group_backend!r}: use 'gloo' (CPU), 'nccl' (CUDA) or None."
            )
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self._owns_group = False

    # environment ----------------------------------------------------------------------------------
    @hookimpl
    def setup_environment(self, cluster: ClusterEnvironment, precision: str) -> None:
        Strategy.setup_environment(self, cluster, precision)
        if dist.is_initialized():
            if dist.get_world_size() != cluster.world_size:
                raise ConfigurationError(
                    f"A process group of size {dist.get_world_size()} exists already, but this run has world "
                    f"size {cluster.world_size}. Destroy it first or launch with matching devices."
                )
            return
        backend = self.process_group_backend or cluster.backend
        timeout = self.timeout or datetime.timedelta(seconds=cluster.timeout_s)
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = self.device
        formed = next(_GROUPS_FORMED)
        # Under several nodes, the round is what every node's workers agree on; each agent's restarts may differ.
        attempt = cluster.restart_count if cluster.rendezvous_round is None else cluster.rendezvous_round
        if cluster.launcher_hosts_store and (attempt > 0 or formed > 0):
            # The launcher's store still holds the keys of the groups formed before this one (a failed
            # attempt's workers, or this process's previous group: a loop that tears down and sets up again,
            # the contract suite's shared launches). A group formed from them would connect to dead or
            # departed peers. Keep each attempt's and each group's keys apart; every rank forms its groups in
            # the same order, so the names agree.
            shared = dist.TCPStore(
                cluster.master_addr, cluster.master_port, cluster.world_size, is_master=False, timeout=timeout
            )
            prefix = f"stratagem/attempt-{attempt}/" + (f"group-{formed}/" if formed else "")
            kwargs["store"] = dist.PrefixStore(prefix, shared)
        else:
            kwargs["init_method"] = f"tcp://{cluster.master_addr}:{cluster.master_port}"
        dist.init_process_group(
            backend=backend,
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=timeout,
            **kwargs,
        )
        self._owns_group = True
        _quiesce_at_exit()

    # collectives -----------------------------------------------------------------------------------
    @hookimpl
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        _check_op(op)
        result = tensor.detach().clone()
        if not dist.is_initialized():
            return result
        if op == "mean":
            # gloo has no AVG: sum in a float type, then divide.
            if not result.is_floating_point():
                result = result.to(torch.float64)
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
            return result / dist.get_world_size()
        dist.all_reduce(result, op=_TORCH_OPS[op])
        return result

    @hookimpl
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not dist.is_initialized():
            return [tensor.detach().clone()]
        world = dist.get_world_size()
        local = tensor.detach().contiguous()
        # Shapes may differ between ranks: exchange them, pad to the largest, gather, then trim.
        shape = torch.tensor(list(local.shape) or [1], dtype=torch.long, device=local.device)
        ndims = [torch.zeros((), dtype=torch.long, device=local.device) for _ in range(world)]
        dist.all_gather(ndims, torch.tensor(local.dim(), dtype=torch.long, device=local.device))
        if len({int(n) for n in ndims}) != 1:
            raise ValueError(
                f"all_gather: ranks passed tensors of different dimensionality {[int(n) for n in ndims]}; "
                "shapes may differ in size but not in number of dimensions."
            )
        shapes = [torch.zeros_like(shape) for _ in range(world)]
        dist.all_gather(shapes, shape)
        if local.dim() == 0:
            gathered = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            return gathered
        largest = torch.stack(shapes).max(dim=0).values.tolist()
        padded = local.new_zeros(largest)
        padded[tuple(slice(0, s) for s in local.shape)] = local
        gathered = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
        return [g[tuple(slice(0, int(s)) for s in sh)].clone() for g, sh in zip(gathered, shapes)]

    @hookimpl
    def broadcast(self, obj: Any, src: int) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @hookimpl
    def barrier(self, name: str | None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()

    # teardown --------------------------------------------------------------------------------------
    @hookimpl
    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            # Every rank reaches this point before the group goes away, so no rank tears down a
            # connection another is still using (which aborts it at exit).
            dist.barrier()
            dist.destroy_process_group()
        self._owns_group = False
