"""The entry point of ``stratagem-tp``: registers ``tp`` and ``fsdp_tp`` without importing torch."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities


def _capabilities(min_world_size: int) -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        # 16-mixed is not declared: its gradient scaler is untested with tensor-parallel DTensor gradients.
        precisions={"32-true", "bf16-mixed", "bf16-true", "16-true"},
        checkpoint_formats={"full", "sharded"},
        min_world_size=min_world_size,
        max_world_size=None,
    )


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "tp",
        "stratagem_tp.strategy:TPStrategy",
        description="Tensor parallel over every process (1-D mesh): split layers by a plan, same batch on all",
        capabilities=_capabilities(2),
    )
    register(
        "fsdp_tp",
        "stratagem_tp.strategy:FSDPTPStrategy",
        description="2-D parallelism: FSDP2 over the data-parallel dim x tensor parallel (mesh ('dp', 'tp'))",
        # As hsdp on one node: 2 processes make a 1 x 2 mesh (FSDP over one rank, tensor parallel over two),
        # which trains like tp and keeps the 2-D layout (and checkpoints) of a larger run.
        capabilities=_capabilities(2),
    )


@hookimpl
def register_install_hints(register: Callable[..., None]) -> None:
    # The other packages of stratagem's plugin family: a user who names one of their strategies or launchers is
    # told what to install (the core names no plugin package). tests/test_install_hints.py keeps this current.
    register("stratagem-ddp", strategies=["ddp", "ddp_find_unused_parameters_true"])
    register("stratagem-fsdp", strategies=["fsdp", "fsdp_cpu_offload", "hsdp"])
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
