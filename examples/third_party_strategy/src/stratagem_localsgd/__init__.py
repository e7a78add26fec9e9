"""stratagem-localsgd: registers the ``local_sgd`` strategy. Imports nothing heavy (listing stays fast)."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import Capabilities, hookimpl

__all__ = ["register_strategies"]


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register(
        "local_sgd",
        # A string: the class (and torch) is imported only when someone picks this strategy.
        "stratagem_localsgd.strategy:LocalSGDStrategy",
        description="Data parallel by hand: gradients averaged every step (sync_every=1), or local steps "
        "with parameters averaged every sync_every steps",
        capabilities=Capabilities(
            accelerators={"cpu", "cuda"},
            precisions={"32-true", "bf16-mixed", "bf16-true"},
            checkpoint_formats={"full", "sharded"},
            min_world_size=1,
        ),
    )
