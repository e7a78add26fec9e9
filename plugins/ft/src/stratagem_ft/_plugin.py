"""The entry point of ``stratagem-ft``: registers the fault-tolerant strategies and the ``replica_groups``
launcher without importing torch or torchft."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities, LauncherCapabilities

#: torchft's wheels from 0.2 on build against the torch this family supports (0.2.0 measured with torch 2.13).
REQUIRES = ("torchft>=0.2",)


def _capabilities(formats: set[str]) -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        precisions={"32-true", "bf16-mixed"},
        checkpoint_formats=formats,
        min_world_size=1,
        max_world_size=None,
        requires=REQUIRES,
        # Untried with torchft's per-step quorum and healing: compile= is refused rather than left to chance.
        compile=False,
    )


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "ft_ddp",
        "stratagem_ft.strategy:FTDDPStrategy",
        description="Replica groups of data parallelism on torchft: a lost group costs the others a step, "
        "not a restart",
        capabilities=_capabilities({"full"}),
    )
    register(
        "ft_hsdp",
        "stratagem_ft.strategy:FTHSDPStrategy",
        description="FSDP2 inside each replica group, torchft's per-step fault tolerance across the groups",
        capabilities=_capabilities({"full", "sharded"}),
    )
    register(
        "diloco",
        "stratagem_ft.diloco:DiLoCoStrategy",
        description="DiLoCo on torchft: replica groups take sync_every local steps, then an outer optimizer step",
        capabilities=_capabilities({"full"}),
    )


@hookimpl
def register_launchers(register: Callable[..., None]) -> None:
    register(
        "replica_groups",
        "stratagem_ft.launcher:ReplicaGroupsLauncher",
        description="The replica groups of ft_ddp/ft_hsdp/diloco, each restarted on its own, and a torchft "
        "lighthouse",
        capabilities=LauncherCapabilities(
            accelerators={"cpu", "cuda"}, multi_node=True, requires=REQUIRES, always_launches=True
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
    register("stratagem-slurm", launchers=["slurm"])
