"""The entry point of ``stratagem-fsdp``: registers the FSDP strategies without importing torch."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities

_FACTORY = "stratagem_fsdp.strategy:FSDPStrategy"


def _capabilities(min_world_size: int = 1, auto_priority: int | None = None) -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        # 16-mixed is CUDA-only; the core refuses it on CPU whatever is declared here.
        precisions={"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"},
        checkpoint_formats={"full", "sharded"},
        min_world_size=min_world_size,
        max_world_size=None,
        auto_priority=auto_priority,
    )


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "fsdp",
        _FACTORY,
        description="FSDP2: parameters, gradients and optimizer state sharded across processes",
        # strategy="auto" with several processes takes it where a plan finds that ddp does not fit (below
        # ddp's priority, so that ddp stays the default where the model is not planned).
        capabilities=_capabilities(auto_priority=5),
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


@hookimpl
def register_install_hints(register: Callable[..., None]) -> None:
    # The other packages of stratagem's plugin family: a user who names one of their strategies or launchers is
    # told what to install (the core names no plugin package). tests/test_install_hints.py keeps this current.
    register("stratagem-ddp", strategies=["ddp", "ddp_find_unused_parameters_true"])
    register("stratagem-tp", strategies=["tp", "fsdp_tp"])
    register("stratagem-pp", strategies=["pp", "pp_fsdp", "pp_fsdp_tp"])
    register(
        "stratagem-deepspeed",
        strategies=[
            "deepspeed",
            "deepspeed_stage_1",
            "deepspeed_stage_2",
            "deepspeed_stage_2_offload",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
        ],
    )
    register("stratagem-ray", launchers=["ray"])
    register("stratagem-slurm", launchers=["slurm"])
    register("stratagem-ft", strategies=["ft_ddp", "ft_hsdp", "diloco"], launchers=["replica_groups"])
