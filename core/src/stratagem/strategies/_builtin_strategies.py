"""The strategies that ship with the core, registered like any plugin's."""

from __future__ import annotations

from collections.abc import Callable

from stratagem.hookspecs import hookimpl
from stratagem.registry.capabilities import Capabilities


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "single_device",
        "stratagem.strategies.single_device:SingleDeviceStrategy",
        description="One process on one device: the reference every other strategy is compared with",
        capabilities=Capabilities(
            accelerators={"cpu", "cuda"},
            precisions={"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"},
            checkpoint_formats={"full", "sharded"},
            min_world_size=1,
            max_world_size=1,
        ),
    )
