"""The entry point of ``stratagem-pp``: registers ``pp``, ``pp_fsdp`` and ``pp_fsdp_tp`` without importing torch."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities


def _capabilities(min_world_size: int) -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        # Mixed and low precisions are not declared yet: the schedules' loss scaling and the stage buffers'
        # dtypes under autocast are untested here.
        precisions={"32-true"},
        checkpoint_formats={"full", "sharded"},
        # Each stage compiled after the split and its activation checkpointing (the contract's compile section
        # passes for every schedule).
        compile=True,
        min_world_size=min_world_size,
        max_world_size=None,
    )


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "pp",
        "stratagem_pp.strategy:PPStrategy",
        description="Pipeline parallel over every process: the model split into stages, micro-batches scheduled",
        # A pipeline needs two stages on two processes at least.
        capabilities=_capabilities(2),
    )
    register(
        "pp_fsdp",
        "stratagem_pp.strategy:PPFSDPStrategy",
        description="2-D: pipeline x FSDP2 (mesh ('pp', 'dp')); each stage sharded over its data-parallel group",
        capabilities=_capabilities(4),
    )
    register(
        "pp_fsdp_tp",
        "stratagem_pp.strategy:PPFSDPTPStrategy",
        description="3-D: pipeline x FSDP2 x tensor parallel (mesh ('pp', 'dp', 'tp')), pipeline outermost",
        capabilities=_capabilities(4),
    )


@hookimpl
def register_install_hints(register: Callable[..., None]) -> None:
    # The other packages of stratagem's plugin family: a user who names one of their strategies or launchers is
    # told what to install (the core names no plugin package). tests/test_install_hints.py keeps this current.
    register("stratagem-ddp", strategies=["ddp", "ddp_find_unused_parameters_true"])
    register("stratagem-fsdp", strategies=["fsdp", "fsdp_cpu_offload", "hsdp"])
    register("stratagem-tp", strategies=["tp", "fsdp_tp"])
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
