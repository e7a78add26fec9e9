"""The entry point: registers the ``slurm`` launcher without importing anything of it."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import LauncherCapabilities


@hookimpl
def register_launchers(register: Callable[..., None]) -> None:
    register(
        "slurm",
        "stratagem_slurm.launcher:SlurmLauncher",
        description="The workers as the tasks of one SLURM batch job, submitted from a login node (sbatch)",
        capabilities=LauncherCapabilities(
            accelerators={"cpu", "cuda"}, multi_node=True, starts_all_nodes=True
        ),
    )


@hookimpl
def register_install_hints(register: Callable[..., None]) -> None:
    # The other packages of stratagem's plugin family: a user who names one of their strategies or launchers is
    # told what to install (the core names no plugin package). tests/test_install_hints.py keeps this current.
    register("stratagem-ddp", strategies=["ddp", "ddp_find_unused_parameters_true"])
    register("stratagem-fsdp", strategies=["fsdp", "fsdp_cpu_offload", "hsdp"])
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
