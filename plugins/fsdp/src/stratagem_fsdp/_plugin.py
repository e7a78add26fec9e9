"""The entry point of ``stratagem-fsdp``: registers the FSDP strategies without importing torch."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities

_FACTORY = "stratagem_fsdp.strategy:FSDPStrategy"


def _capabilities(min_world_size: int = 1) -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        # 16-mixed is CUDA-only; the core refuses it on CPU whatever is declared here.
        precisions={"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"},
        checkpoint_formats={"full", "sharded"},
        min_world_size=min_world_size,
        max_world_size=None,
    )


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "fsdp",
        _FACTORY,
        description="FSDP2: parameters, gradients and optimizer state sharded across processes",
        capabilities=_capabilities(),
    )
    register(
        "fsdp_cpu_offload",
        _FACTORY,
        description="fsdp with sharded parameters, gradients and optimizer state kept in host memory (CUDA)",
        capabilities=_capabilities(),
        cpu_offload=True,
    )
    register(
        "hsdp",
        _FACTORY,
        description="FSDP2 HYBRID_SHARD: sharded within a node, replicated across nodes (2D mesh; 1 x N on one node)",
        capabilities=_capabilities(),
        sharding_strategy="HYBRID_SHARD",
    )
