"""The plan: each strategy asked about, answered by its ``estimate_memory`` hook or simulated rank by rank.

Ranks differ (pipeline stages hold different blocks, uneven shards leave the last ranks less), so a strategy is
set up on several: rank 0 (set up and stepped), and along each dimension of the strategy's device mesh the rank at
the far end of it (and the world's last rank), set up only. If one of those holds more parameters than rank 0, it
is stepped too; the largest is reported. With ``ranks="all"`` every rank is set up and stepped (small worlds: the
contract suite's check). On several cores the ranks after the first are simulated in forked children while this
process simulates the first (``_parallel``): the far ranks are known beforehand from the mesh the strategy's
``setup_environment`` forms.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stratagem.errors import StratagemError
from stratagem.planning._parallel import default_workers, run_jobs
from stratagem.planning._results import ESTIMATED, NOT_ESTIMATED, SIMULATED, Plan, StrategyPlan
from stratagem.planning._simulate import RankMemory, mesh_of, simulate_rank
from stratagem.planning._units import format_bytes
from stratagem.planning._workload import Workload, World

Progress = Callable[[str], None]
RANK_CHOICES = ("largest", "all")


def default_strategies(world: World) -> list[str]:
    """Every installed strategy whose declarations accept this world's size and precision."""
    from stratagem.registry._manager import get_registry

    return [
        info.name
        for info in get_registry()
        if info.capabilities.refusal(precision=world.precision, world_size=world.size) is None
    ]


def far_ranks(shape: tuple[int, ...] | None, world_size: int) -> list[int]:
    """Rank 0's neighbours at the far end of each mesh dimension (ranks numbered row-major over the mesh, as
    ``init_device_mesh`` numbers them), and the last rank."""
    found = []
    if shape:
        stride = 1
        strides = []
        for size in reversed(shape):
            strides.append(stride)
            stride *= size
        for size, step in zip(shape, reversed(strides)):
            found.append((size - 1) * step)
    found.append(world_size - 1)
    return sorted({r for r in found if 0 < r < world_size})


def plan(
    workload: Workload,
    world: World,
    *,
    memory: int | None = None,
    strategies: Sequence[str] | None = None,
    ranks: str = "largest",
    progress: Progress | None = None,
    workers: int | None = None,
) -> Plan:
    """Plan ``workload`` on ``world`` under each of ``strategies`` (default: every installed one that accepts
    the world's size and precision).

    :param memory: each device's memory in bytes; ``fits`` compares each strategy's largest rank with it.
    :param ranks: ``"largest"`` (see the module docstring) or ``"all"``.
    :param progress: called with a line of text as each strategy and rank is done.
    :param workers: processes simulating ranks at once (default: the cores this process may use); the ranks after
        the first are simulated in forked children while this process simulates the first. 1: all in this process.
    """
    from stratagem.registry._labels import parse_label
    from stratagem.registry._manager import get_registry

    if ranks not in RANK_CHOICES:
        raise StratagemError(f"ranks={ranks!r}: use one of {', '.join(RANK_CHOICES)}.")
    if workers is None:
        workers = default_workers()
    elif workers < 1:
        raise StratagemError(f"workers={workers}: give 1 or more processes to simulate ranks with.")
    registry = get_registry()
    labels = list(strategies) if strategies is not None else default_strategies(world)
    parsed = [(label, *parse_label(label, "strategies")) for label in labels]
    for _, name, _ in parsed:
        registry.get(name)  # an unknown name fails the whole plan at once, naming the closest
    with torch.device("meta"):
        shape_model = workload.build()
    count = sum(p.numel() for p in {id(p): p for p in shape_model.parameters()}.values())
    results = []
    for label, name, options in parsed:
        start = time.perf_counter()
        result = _plan_one(
            label, registry.get(name), options, workload, world, shape_model, ranks, progress, workers
        )
        fits = None if memory is None or result.largest is None else result.largest.total <= memory
        seconds = time.perf_counter() - start
        results.append(_evolve(result, fits=fits, seconds=seconds))
        if progress is not None:
            progress(_summary(results[-1], memory))
    return Plan(
        model=workload.name, parameter_count=count, world=world, memory=memory, strategies=tuple(results)
    )


def _evolve(result: StrategyPlan, **changes: Any) -> StrategyPlan:
    import attrs

    return attrs.evolve(result, **changes)


def _summary(result: StrategyPlan, memory: int | None) -> str:
    if result.largest is None:
        return f"{result.name}: {result.status} ({result.reason})"
    verdict = "" if memory is None else ("  fits" if result.fits else "  does not fit")
    return (
        f"{result.name}: rank {result.largest.rank} holds {format_bytes(result.largest.total)}{verdict} "
        f"[{result.status}, {result.seconds:.1f} s]"
    )


def _plan_one(
    label: str,
    info: Any,
    options: dict[str, Any],
    workload: Workload,
    world: World,
    shape_model: torch.nn.Module,
    ranks: str,
    progress: Progress | None,
    workers: int,
) -> StrategyPlan:
    refusal = info.capabilities.refusal(precision=world.precision, world_size=world.size)
    if refusal is not None:
        what, value = refusal
        return StrategyPlan(
            name=label, status=NOT_ESTIMATED, reason=f"{info.name} does not declare {what} {value!r}"
        )
    missing = info.capabilities.missing_requirements()
    if missing:
        return StrategyPlan(
            name=label, status=NOT_ESTIMATED, reason=f"needs {', '.join(missing)}, not installed"
        )
    # The strategy's own notes (a choice made for the user, an option that does nothing here) and torch's
    # warnings go with its plan rather than to the terminal, once each.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _answer(label, info, options, workload, world, shape_model, ranks, progress, workers)
    notes = tuple(dict.fromkeys(str(w.message) for w in caught))
    return _evolve(result, warnings=notes)


def _answer(
    label: str,
    info: Any,
    options: dict[str, Any],
    workload: Workload,
    world: World,
    shape_model: torch.nn.Module,
    ranks: str,
    progress: Progress | None,
    workers: int,
) -> StrategyPlan:
    try:
        estimate = _estimate(info, options, shape_model, world)
        if estimate is not None:
            rank = estimate.as_rank()
            return StrategyPlan(name=label, status=ESTIMATED, largest=rank, ranks=(rank,))
        return _simulate(label, info, options, workload, world, ranks, progress, workers)
    except StratagemError as error:
        return StrategyPlan(name=label, status=NOT_ESTIMATED, reason=str(error))
    except Exception as error:  # a strategy whose hooks do not run on a simulated world: say so, go on
        return StrategyPlan(name=label, status=NOT_ESTIMATED, reason=_failure(error))


def _failure(error: Exception) -> str:
    from torch._subclasses.fake_tensor import DataDependentOutputException

    where = traceback.extract_tb(error.__traceback__)[-1]
    at = f" (at {where.filename}:{where.lineno})"
    if isinstance(error, DataDependentOutputException):
        return (
            "its step reads the value of a tensor (in the strategy, torch's C++ or the model), and the "
            f"simulated world's tensors have shapes but no values{at}"
        )
    return f"its hooks did not run on the simulated world: {type(error).__name__}: {error}{at}"


def _estimate(info: Any, options: dict[str, Any], shape_model: torch.nn.Module, world: World) -> Any:
    from stratagem.registry._manager import StrategyHooks

    return StrategyHooks(info.create(**options), addons=[]).estimate_memory(shape_model, world)


def _simulate(
    label: str,
    info: Any,
    options: dict[str, Any],
    workload: Workload,
    world: World,
    ranks: str,
    progress: Progress | None,
    workers: int,
) -> StrategyPlan:
    def simulate(rank: int, step: bool) -> tuple[RankMemory, Any]:
        return simulate_rank(info, options, workload, world, rank, step=step)

    def run(jobs: list[tuple[int, bool]]) -> list[RankMemory]:
        done = run_jobs(jobs, simulate, _failure, workers)
        for (_, step), (memory, _) in zip(jobs, done):
            if progress is not None:
                what = "set up and stepped" if step else "set up"
                progress(f"{label}: rank {memory.rank} {what} in {memory.seconds:.1f} s")
        facts.extend(found for _, found in done[:1])
        return [memory for memory, _ in done]

    facts: list[Any] = []
    if ranks == "all":
        planned = run([(rank, True) for rank in range(world.size)])
        largest = max(planned, key=lambda r: (r.total, -r.rank))
    else:
        if workers > 1:  # the far ranks are known from the mesh before rank 0 runs: set up meanwhile
            far = far_ranks(mesh_of(info, options, world), world.size)
            first, *others = run([(0, True), *((rank, False) for rank in far)])
        else:
            (first,) = run([(0, True)])
            others = run([(rank, False) for rank in far_ranks(facts[0].mesh, world.size)])
        # A rank holding more parameters than every rank before it is stepped too; the last such is the largest.
        held = first.parameters + first.buffers
        more = []
        for other in others:
            if other.parameters + other.buffers > held:
                held = other.parameters + other.buffers
                more.append(other.rank)
        stepped = {memory.rank: memory for memory in run([(rank, True) for rank in more])} if more else {}
        planned = [first, *(stepped.get(other.rank, other) for other in others)]
        largest = stepped[more[-1]] if more else first
    return StrategyPlan(
        name=label,
        status=SIMULATED,
        largest=largest,
        ranks=tuple(planned),
        groups=facts[0].groups,
        mesh=facts[0].mesh,
    )
