"""Planning a run before it starts: which strategy fits a model on a cluster, and with how much memory per device.

:func:`plan` sets the model up under each strategy as ranks of a simulated world, in this process, on fake
tensors: the strategy's own hooks (``setup_environment``, ``wrap_model``, ``setup_optimizers``, one step) run as
they would on rank ``r`` of ``n``, and what the rank holds is counted from its tensors. A strategy whose hooks
cannot run so answers through its ``estimate_memory`` hook. ``stratagem plan`` is the command line of it, and
``strategy="auto"`` chooses with it. docs/planning.md says how to read a plan and what it leaves out.

Imports torch: import it when planning, not with ``import stratagem``.
"""

from stratagem.planning._choice import Choice, NothingFitsError, choose
from stratagem.planning._plan import default_strategies, plan
from stratagem.planning._results import (
    ESTIMATED,
    NOT_ESTIMATED,
    SIMULATED,
    MemoryEstimate,
    Plan,
    StrategyPlan,
)
from stratagem.planning._simulate import RankMemory
from stratagem.planning._units import format_bytes, parse_bytes, parse_count
from stratagem.planning._workload import OPTIMIZERS, Workload, World, token_batch, token_step

__all__ = [
    "ESTIMATED",
    "NOT_ESTIMATED",
    "OPTIMIZERS",
    "SIMULATED",
    "Choice",
    "MemoryEstimate",
    "NothingFitsError",
    "Plan",
    "RankMemory",
    "StrategyPlan",
    "Workload",
    "World",
    "choose",
    "default_strategies",
    "format_bytes",
    "parse_bytes",
    "parse_count",
    "plan",
    "token_batch",
    "token_step",
]
