"""The entry point of ``stratagem-ddp``: registers the DDP strategies without importing torch."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities

_FACTORY = "stratagem_ddp.strategy:DDPStrategy"


def _capabilities(auto_priority: int | None = None) -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        # 16-mixed is CUDA-only; the core refuses it on CPU whatever is declared here.
        precisions={"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"},
        checkpoint_formats={"full"},
        min_world_size=1,
        max_world_size=None,
        auto_priority=auto_priority,
    )


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "ddp",
        _FACTORY,
        description="DistributedDataParallel: a full replica per process, gradients all-reduced in buckets",
        # strategy="auto" with several processes: plain data parallelism, the safest default for any model.
        capabilities=_capabilities(auto_priority=10),
    )
    register(
        "ddp_find_unused_parameters_true",
        _FACTORY,
        description="ddp with find_unused_parameters=True, for models that skip parameters in some steps",
        capabilities=_capabilities(),
        find_unused_parameters=True,
    )


@hookimpl
def register_install_hints(register: Callable[..., None]) -> None:
    # The other packages of stratagem's plugin family: a user who names one of their strategies or launchers is
    # told what to install (the core names no plugin package). tests/test_install_hints.py keeps this current.
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
