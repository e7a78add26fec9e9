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
