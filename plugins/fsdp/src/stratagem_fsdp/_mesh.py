"""The device mesh and the per-unit ``fully_shard`` arguments each sharding strategy stands for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    from stratagem.launchers.cluster import ClusterEnvironment
    from stratagem_fsdp._config import FSDPConfig

#: Names of a 2D mesh's dimensions: FSDP2 replicates over dim 0 and shards over dim 1.
HYBRID_DIM_NAMES = ("replicate", "shard")


@attrs.frozen
class ShardPlan:
    """What a sharding strategy means in FSDP2 terms.

    :param mesh_shape: ``(world,)`` to shard over every process, ``(replicas, shards)`` for a 2D mesh.
    :param unit_reshard: ``reshard_after_forward`` of each policy-selected unit.
    :param root_reshard: the same for the root (``None``: FSDP2's default, which keeps the root gathered
        because backward needs it first).
    :param note: a message to show once (a choice made for the user), or ``None``.
    """

    mesh_shape: tuple[int, ...]
    unit_reshard: bool | int
    root_reshard: bool | int | None
    note: str | None = None

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return HYBRID_DIM_NAMES if len(self.mesh_shape) == 2 else None


def plan(config: FSDPConfig, cluster: ClusterEnvironment) -> ShardPlan:
    """Resolve ``config.sharding_strategy`` (and ``reshard_after_forward``) for this cluster."""
    world = cluster.world_size
    note = None
    match config.sharding_strategy:
        case "FULL_SHARD":
            shape, unit, root = (world,), True, None
        case "SHARD_GRAD_OP":
            shape, unit, root = (world,), False, False
        case "NO_SHARD":
            # Replicas of size one: FSDP2 on a (world, 1) mesh all-reduces gradients like DDP, and keeps
            # the DTensor state dicts that make checkpoints work as for the sharded strategies.
            shape, unit, root = (world, 1), False, False
        case "HYBRID_SHARD" | "_HYBRID_SHARD_ZERO2":
            replicas, shards, note = hybrid_sizes(config, cluster)
            keep = config.sharding_strategy == "_HYBRID_SHARD_ZERO2"
            shape, unit, root = (replicas, shards), not keep, (False if keep else None)
        case other:
            raise ValueError(
                f"sharding_strategy={other!r} is unknown; use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."
            )
    if config.reshard_after_forward is not None:
        unit = root = config.reshard_after_forward
    return ShardPlan(mesh_shape=shape, unit_reshard=unit, root_reshard=root, note=note)


def hybrid_sizes(config: FSDPConfig, cluster: ClusterEnvironment) -> tuple[int, int, str | None]:
    """``(replicas, shards per replica)`` for HYBRID_SHARD, and a note when the choice was made here."""
    world = cluster.world_size
    replicas, shards = config.replicate_size, config.shard_size
    note = None
    if replicas is None and shards is None:
        # Shard within a node, replicate across nodes. One node is one replica: the mesh is 1 x N, which
        # trains like FULL_SHARD and keeps the 2-D layout (and its checkpoints) of a multi-node run.
        replicas, shards = cluster.num_nodes, world // cluster.num_nodes
        if cluster.num_nodes == 1:
            note = (
                f"HYBRID_SHARD on one node: 1 replica of {shards} shards (a 1 x {shards} mesh). Pass "
                "FSDPStrategy(sharding_strategy='HYBRID_SHARD', replicate_size=R) for R replicas."
            )
    elif replicas is None:
        replicas = world // shards if shards and world % shards == 0 else None
    elif shards is None:
        shards = world // replicas if world % replicas == 0 else None
    if replicas is None or shards is None or replicas * shards != world:
        raise ConfigurationError(
            f"FSDPStrategy(replicate_size={config.replicate_size!r}, shard_size={config.shard_size!r}): "
            f"replicate_size x shard_size must equal the world size {world}."
        )
    return replicas, shards, note


def build_mesh(shard_plan: ShardPlan, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shard_plan.mesh_shape, mesh_dim_names=shard_plan.mesh_dim_names)
