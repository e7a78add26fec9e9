"""``strategy="auto"``'s choice, made from a plan: among the strategies that fit, the one whose ranks send the
least per step; ties go to the simpler one (fewer process groups of its own), then to the one that holds less.

A strategy is a candidate when its largest rank fits the device memory and its communication was measured (a
pipeline's is not: :mod:`stratagem.planning._simulate`). When none that fits was measured (a step that reads a
tensor's value), the one with the fewest process groups, then the least memory, is taken, and the line says so.
Nothing fits: :class:`NothingFitsError`, with the plan's table of what each strategy needs.
"""

from __future__ import annotations

import attrs

from stratagem.errors import ConfigurationError
from stratagem.planning._results import Plan, StrategyPlan
from stratagem.planning._table import text_table
from stratagem.planning._units import format_bytes


class NothingFitsError(ConfigurationError):
    """No strategy's largest rank fits the device memory; the message holds the plan's table."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        memory = format_bytes(plan.memory)
        super().__init__(
            f"strategy='auto': no installed strategy fits {plan.model} on {plan.world.size} device(s) of "
            f"{memory}. What each needs per device:\n{text_table(plan)}\n"
            "Use more devices, a smaller micro-batch, a lower precision (bf16-true), or activation "
            "checkpointing; or name a strategy."
        )


@attrs.frozen
class Choice:
    """The strategy chosen and the line that says why."""

    strategy: StrategyPlan
    reason: str


def _key(strategy: StrategyPlan) -> tuple[int, int, int, str]:
    largest = strategy.largest
    assert largest is not None and largest.communication is not None
    return (largest.communication, strategy.groups, largest.total, strategy.name)


def candidates(plan: Plan) -> list[StrategyPlan]:
    return [
        s for s in plan.strategies if s.fits and s.largest is not None and s.largest.communication is not None
    ]


def _unmeasured_key(strategy: StrategyPlan) -> tuple[int, int, str]:
    assert strategy.largest is not None
    return (strategy.groups, strategy.largest.total, strategy.name)


def choose(plan: Plan) -> Choice:
    """The strategy ``auto`` takes from ``plan`` (see the module docstring)."""
    found = sorted(candidates(plan), key=_key)
    fitting = [s for s in plan.strategies if s.fits and s.largest is not None]
    if not found and fitting:
        # None whose communication was measured (a step that reads a tensor's value): the simpler that fits.
        best = min(fitting, key=_unmeasured_key)
        assert best.largest is not None
        reason = (
            f"strategy='auto' chose {best.name!r}: its largest rank holds {format_bytes(best.largest.total)} of "
            f"{format_bytes(plan.memory)}; the communication of none that fit could be measured "
            f"({best.largest.note or 'see the plan'}), so the one with the fewest process groups"
        )
        return Choice(strategy=best, reason=reason + " (stratagem plan for the table).")
    if not found:
        raise NothingFitsError(plan)
    best = found[0]
    largest = best.largest
    assert largest is not None
    others = len([s for s in plan.strategies if s.fits]) - 1
    reason = (
        f"strategy='auto' chose {best.name!r}: its largest rank holds {format_bytes(largest.total)} of "
        f"{format_bytes(plan.memory)} and sends {format_bytes(largest.communication)} per step, the least of "
        f"the {others + 1} that fit"
    )
    if others == 0:
        reason = (
            f"strategy='auto' chose {best.name!r}, the only installed strategy that fits: its largest rank "
            f"holds {format_bytes(largest.total)} of {format_bytes(plan.memory)}"
        )
    return Choice(strategy=best, reason=reason + " (stratagem plan for the table).")
