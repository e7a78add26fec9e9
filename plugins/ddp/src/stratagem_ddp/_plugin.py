"""The entry point of ``stratagem-ddp``: registers the DDP strategies without importing torch."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import Capabilities

_FACTORY = "stratagem_ddp.strategy:DDPStrategy"


def _capabilities() -> Capabilities:
    return Capabilities(
        accelerators={"cpu", "cuda"},
        # 16-mixed is CUDA-only; the core refuses it on CPU whatever is declared here.
        precisions={"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"},
        checkpoint_formats={"full"},
        min_world_size=1,
        max_world_size=None,
    )


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "ddp",
        _FACTORY,
        description="DistributedDataParallel: a full replica per process, gradients all-reduced in buckets",
        capabilities=_capabilities(),
    )
    register(
        "ddp_find_unused_parameters_true",
        _FACTORY,
        description="ddp with find_unused_parameters=True, for models that skip parameters in some steps",
        capabilities=_capabilities(),
        find_unused_parameters=True,
    )
