"""Where this process runs, read once from the environment.

Strategies read a :class:`ClusterEnvironment` and never parse environment variables themselves.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import attrs

from stratagem.errors import ConfigurationError


@attrs.frozen(kw_only=True)
class ClusterEnvironment:
    """The position of this process in the run.

    :param rank: global rank.
    :param local_rank: rank within this node.
    :param world_size: number of processes in the run.
    :param node_rank: index of this node.
    :param num_nodes: number of nodes.
    :param master_addr: address of rank 0's rendezvous store.
    :param master_port: its port.
    :param accelerator: ``cpu`` or ``cuda``.
    :param device: the ``torch.device`` string this process computes on (``cpu``, ``cuda:1``).
    :param backend: the ``torch.distributed`` backend (``gloo`` or ``nccl``).
    :param timeout_s: the process-group timeout in seconds.
    :param source: what launched the process: ``single``, ``torchrun`` (also stratagem's own launcher) or ``slurm``.
    :param restart_count: how many times the launcher restarted this worker group (0 in the first attempt).
    :param rendezvous_round: the round of torch's c10d rendezvous this worker group formed in, the same on every
        node (stratagem's agent says it; ``None`` otherwise).
    :param launcher_hosts_store: the store at ``master_addr:master_port`` belongs to the launcher (torch's
        elastic agent sharing its rendezvous store) and outlives a restart, keeping the last attempt's keys.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    accelerator: str = "cpu"
    device: str = "cpu"
    backend: str = "gloo"
    timeout_s: float = 1800.0
    source: str = "single"
    restart_count: int = 0
    rendezvous_round: int | None = None
    launcher_hosts_store: bool = False

    @property
    def local_world_size(self) -> int:
        return self.world_size // max(self.num_nodes, 1)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0


def launched_externally(environ: Mapping[str, str] | None = None) -> str | None:
    """``"torchrun"`` or ``"slurm"`` when the processes already exist, else ``None``."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "torchrun"
    # An interactive `srun --pty bash` has one task: treat it as a single process.
    if (
        "SLURM_PROCID" in env
        and int(env.get("SLURM_NTASKS", "1")) > 1
        and env.get("SLURM_JOB_NAME")
        not in (
            "bash",
            "interactive",
        )
    ):
        return "slurm"
    return None


def slurm_job(environ: Mapping[str, str] | None = None) -> str | None:
    """The id of the SLURM job this process runs in (a batch script, an ``srun`` task, or a worker that a
    launcher started inside the job), or ``None`` outside SLURM."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def _slurm_master_addr(nodelist: str) -> str:
    # "node[003-005,007],gpu1" -> "node003"
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    match = re.match(r"([^\[]+)\[([^\]]+)\]", first)
    if not match:
        return first
    number = re.split(r"[-,]", match.group(2))[0]
    return match.group(1) + number


def _cuda_index(local_rank: int) -> int:
    """The CUDA device of this local rank: its own index among the node's devices, or the only one it sees when
    the launcher gave each worker a device of its own (Ray sets ``CUDA_VISIBLE_DEVICES`` per actor)."""
    import torch

    return 0 if torch.cuda.device_count() == 1 else local_rank


def resolve_accelerator(accelerator: str) -> str:
    if accelerator not in ("auto", "cpu", "cuda", "gpu"):
        raise ConfigurationError(f"accelerator={accelerator!r} is not one of 'auto', 'cpu', 'cuda'.")
    if accelerator == "gpu":
        accelerator = "cuda"
    if accelerator == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def detect(
    *,
    accelerator: str,
    devices: int,
    num_nodes: int,
    timeout_s: float,
    environ: Mapping[str, str] | None = None,
) -> ClusterEnvironment:
    """Build this process's environment from torchrun's or SLURM's variables, or a single process."""
    env = os.environ if environ is None else environ
    source = launched_externally(env)
    if source == "torchrun":
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", str(rank // max(local_world, 1)))))
        nodes = max(world_size // max(local_world, 1), 1)
        addr, port = env["MASTER_ADDR"], int(env.get("MASTER_PORT", "29500"))
    elif source == "slurm":
        rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", "0"))
        node_rank = int(env.get("SLURM_NODEID", "0"))
        nodes = int(env.get("SLURM_NNODES", str(num_nodes)))
        addr = env.get("MASTER_ADDR") or _slurm_master_addr(env.get("SLURM_NODELIST", "127.0.0.1"))
        # A port derived from the job id, so that every task of the job agrees without talking.
        port = int(env.get("MASTER_PORT") or 15000 + int(env.get("SLURM_JOB_ID", "0")) % 5000)
    else:
        rank, local_rank, world_size, node_rank, nodes = 0, 0, 1, 0, 1
        addr, port = "127.0.0.1", int(env.get("MASTER_PORT", "29500"))
    if accelerator == "cuda":
        device, backend = f"cuda:{_cuda_index(local_rank)}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    return ClusterEnvironment(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        node_rank=node_rank,
        num_nodes=nodes,
        master_addr=addr,
        master_port=port,
        accelerator=accelerator,
        device=device,
        backend=backend,
        timeout_s=timeout_s,
        source=source or "single",
        # stratagem's agent counts every restart (a node joining too); torch's counts those after a failure.
        restart_count=int(env.get("STRATAGEM_RESTART_COUNT") or env.get("TORCHELASTIC_RESTART_COUNT") or 0),
        rendezvous_round=int(env["STRATAGEM_RENDEZVOUS_ROUND"])
        if env.get("STRATAGEM_RENDEZVOUS_ROUND")
        else None,
        launcher_hosts_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )
