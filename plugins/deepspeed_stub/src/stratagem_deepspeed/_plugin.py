"""The entry point of ``stratagem-deepspeed``: registers the DeepSpeed strategies without importing torch or
deepspeed, so that they list (marked as needing ``deepspeed``) even where it is not installed."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities

_FACTORY = "stratagem_deepspeed.strategy:DeepSpeedStrategy"
#: What `pip install stratagem-deepspeed[deepspeed]` adds; the core refuses the names before launch without it.
REQUIREMENT = "deepspeed>=0.14"


def _capabilities() -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        # DeepSpeed trains in fp32, bf16 and (CUDA only; the core refuses it on CPU) fp16 with loss scaling.
        precisions={"32-true", "bf16-mixed", "bf16-true", "16-mixed"},
        # sharded: DeepSpeed's own checkpoint directory; full: one stratagem file that every strategy loads.
        checkpoint_formats={"full", "sharded"},
        min_world_size=1,
        requires=(REQUIREMENT,),
    )


_NAMES = (
    (
        "deepspeed",
        "DeepSpeed ZeRO (stage 2 unless options say otherwise; config= takes a DeepSpeed config)",
        {},
    ),
    (
        "deepspeed_stage_1",
        "DeepSpeed ZeRO stage 1: optimizer state partitioned across processes",
        {"stage": 1},
    ),
    ("deepspeed_stage_2", "DeepSpeed ZeRO stage 2: optimizer state and gradients partitioned", {"stage": 2}),
    (
        "deepspeed_stage_2_offload",
        "DeepSpeed ZeRO stage 2 with the optimizer state and step in CPU memory",
        {"stage": 2, "offload_optimizer": True},
    ),
    (
        "deepspeed_stage_3",
        "DeepSpeed ZeRO stage 3: parameters, gradients and optimizer state partitioned",
        {"stage": 3},
    ),
    (
        "deepspeed_stage_3_offload",
        "DeepSpeed ZeRO stage 3 with parameters and optimizer state in CPU memory",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
)


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    for name, description, preset in _NAMES:
        register(name, _FACTORY, description=description, capabilities=_capabilities(), **preset)


@hookimpl
def register_install_hints(register: Callable[..., None]) -> None:
    # The other packages of stratagem's plugin family: a user who names one of their strategies or launchers is
    # told what to install (the core names no plugin package). tests/test_install_hints.py keeps this current.
    register("stratagem-ddp", strategies=["ddp", "ddp_find_unused_parameters_true"])
    register("stratagem-fsdp", strategies=["fsdp", "fsdp_cpu_offload", "hsdp"])
    register("stratagem-tp", strategies=["tp", "fsdp_tp"])
    register("stratagem-pp", strategies=["pp", "pp_fsdp", "pp_fsdp_tp"])
    register("stratagem-ray", launchers=["ray"])
    register("stratagem-slurm", launchers=["slurm"])
