"""What the plan reports: per strategy, its largest rank (or why it has none), and whether that fits."""

from __future__ import annotations

from typing import Any

import attrs

from stratagem.planning._simulate import RankMemory

#: How a strategy's numbers were obtained.
#: A strategy's status in the plan: its hooks ran on the simulated world.
SIMULATED = "simulated"
#: Its ``estimate_memory`` hook answered.
ESTIMATED = "estimated"
#: Neither: the reason says why (never guessed).
NOT_ESTIMATED = "not estimated"


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """A strategy's own estimate of its largest rank, the answer of the ``estimate_memory`` hook.

    :param parameters: bytes of parameters on the rank.
    :param gradients: bytes of gradients after backward.
    :param optimizer: bytes of optimizer state after a step.
    :param method: how the numbers were obtained, shown in the plan (the rule, what it leaves out).
    :param activations: bytes of activations of one micro-batch, or ``None`` if not estimated.
    :param communication: bytes the rank sends per step, or ``None`` if not estimated.
    :param buffers: bytes of buffers.
    :param rank: which rank these are (the largest).
    """

    parameters: int
    gradients: int
    optimizer: int
    method: str
    activations: int | None = None
    communication: int | None = None
    buffers: int = 0
    rank: int = 0

    def as_rank(self) -> RankMemory:
        return RankMemory(
            rank=self.rank,
            parameters=self.parameters,
            buffers=self.buffers,
            gradients=self.gradients,
            optimizer=self.optimizer,
            activations=self.activations,
            communication=self.communication,
            note=self.method,
        )


@attrs.frozen(kw_only=True)
class StrategyPlan:
    """One strategy in the plan.

    :param name: as asked (``fsdp_tp[tensor_parallel_size=8]``).
    :param status: ``simulated`` (its hooks ran on the simulated world), ``estimated`` (its
        ``estimate_memory`` hook answered) or ``not estimated`` (``reason`` says why).
    :param largest: the rank reported: the one holding the most among those planned.
    :param ranks: every rank planned (the largest was stepped; others set up to compare their parameters).
    :param fits: whether ``largest.total`` is at most the device memory (``None`` when none was given).
    :param groups: process groups the strategy formed beyond the world's (a measure of its complexity).
    """

    name: str
    status: str
    largest: RankMemory | None = None
    ranks: tuple[RankMemory, ...] = ()
    fits: bool | None = None
    reason: str = ""
    groups: int = 0
    mesh: tuple[int, ...] | None = None
    seconds: float = 0.0
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        largest = self.largest
        keys = ("parameters", "gradients", "optimizer", "activations", "total")
        out: dict[str, Any] = {
            "name": self.name,
            "status": self.status,
            "fits": bool(self.fits),
            "rank": None if largest is None else largest.rank,
        }
        out.update({key: None if largest is None else getattr(largest, key) for key in keys})
        out.update(
            buffers=None if largest is None else largest.buffers,
            communication=None if largest is None else largest.communication,
            collectives={} if largest is None else largest.collectives,
            note=self.reason or ("" if largest is None else largest.note),
            mesh=list(self.mesh) if self.mesh else None,
            ranks_planned=[r.rank for r in self.ranks],
            warnings=list(self.warnings),
            seconds=round(self.seconds, 3),
        )
        return out


@attrs.frozen(kw_only=True)
class Plan:
    """The plan of one model on one world: a :class:`StrategyPlan` per strategy asked about."""

    model: str
    parameter_count: int
    world: Any
    memory: int | None
    strategies: tuple[StrategyPlan, ...]

    def get(self, name: str) -> StrategyPlan:
        for strategy in self.strategies:
            if strategy.name == name:
                return strategy
        raise KeyError(f"{name!r} is not in this plan: {', '.join(s.name for s in self.strategies)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "parameter_count": self.parameter_count,
            "world": self.world.to_json(),
            "memory": self.memory,
            "strategies": [s.to_json() for s in self.strategies],
        }
