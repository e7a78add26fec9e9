"""Strategies that exist only to test the contract suite, registered through a real entry point.

``core/tests/test_contract_suite.py`` installs this package as the distribution ``stratagem-contract-fixtures``
(a ``dist-info`` with an entry point, on the path of the pytest run it starts), so the suite finds them the
way it finds any plugin. One is correct; each of the others breaks one promise.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from stratagem import Capabilities, hookimpl

_CAPABILITIES = Capabilities(
    accelerators={"cpu"}, precisions={"32-true"}, checkpoint_formats={"full", "sharded"}, min_world_size=2
)
_STRATEGIES = {
    "contract_gradient_averaging": (
        "GradientAveraging",
        "Hand-written data parallel: gradients averaged after backward (correct)",
    ),
    "contract_broken_all_reduce": (
        "BrokenAllReduce",
        "all_reduce(op='mean') forgets to divide by the world size",
    ),
    "contract_broken_optimizer_checkpoint": (
        "DropsOptimizerState",
        "Checkpoints leave the optimizer state out",
    ),
    "contract_broken_resume": (
        "LossyResume",
        "Fixed-point gradients with error feedback whose residual is not checkpointed",
    ),
}


#: Declares that it cannot be compiled: the suite's compile section must skip it, naming the declaration.
_NOT_COMPILED = {"contract_broken_all_reduce"}


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    for name, (cls, description) in _STRATEGIES.items():
        caps = attrs.evolve(_CAPABILITIES, compile=False) if name in _NOT_COMPILED else _CAPABILITIES
        register(name, f"{__name__}.strategies:{cls}", description=description, capabilities=caps)
    # Written as a third party would, from the hook specs and docs/plugin-authors.md alone (zero_ddp.py).
    register(
        "contract_zero_ddp",
        f"{__name__}.zero_ddp:ZeroDDP",
        description="DDP with a ZeroRedundancyOptimizer; checkpoints customised through the hooks only",
        capabilities=Capabilities(
            accelerators={"cpu"}, precisions={"32-true"}, checkpoint_formats={"full"}, min_world_size=2
        ),
    )
