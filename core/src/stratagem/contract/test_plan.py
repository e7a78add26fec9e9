"""The plan (``stratagem plan``) against the run: what each rank holds after one step.

The workers count, on every rank, the bytes of parameters, buffers, gradients and optimizer state after one
optimizer step of a fresh model (``Strategy.memory_held``). This process plans the same model, micro-batch and
optimizer on the same world size with :func:`stratagem.planning.plan`: a simulated strategy is set up and
stepped as each of its ranks, an estimated one gives its largest rank. They must be equal, byte for byte.
"""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract import _suite_model as m
from stratagem.contract._comparisons import fail_on, section, skip_undeclared

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

KEYS = ("parameters", "buffers", "gradients", "optimizer")


def planned(run: Any) -> Any:
    from stratagem.planning import World, plan

    world = World(devices=run.subject.world_size, batch_size=m.PER_RANK_BATCH, sequence_length=m.SEQUENCE)
    return plan(m.plan_workload(), world, strategies=[run.subject.name], ranks="all").strategies[0]


def test_the_plan_holds_what_the_run_holds(contract_run: Any) -> None:
    subject = contract_run.subject
    if subject.no_training:
        skip_undeclared("precisions", "32-true", subject.no_training)
    held = section(contract_run, 1, "held")
    result = planned(contract_run)
    if result.largest is None:
        pytest.fail(
            f"stratagem plan could not estimate {subject.name}: {result.reason}. A strategy whose hooks cannot "
            "run on the plan's simulated world implements estimate_memory (docs/hooks.md).",
            pytrace=False,
        )
    problems = []
    for rank_plan in result.ranks:
        real = held.get(rank_plan.rank)
        if real is None:
            problems.append(f"rank {rank_plan.rank}: planned, but the run has no such rank")
            continue
        for key in KEYS:
            if getattr(rank_plan, key) != real[key]:
                problems.append(
                    f"rank {rank_plan.rank} {key}: the plan ({result.status}) says {getattr(rank_plan, key)} "
                    f"bytes, the run holds {real[key]}"
                )
    if result.status == "simulated" and sorted(r.rank for r in result.ranks) != sorted(held):
        problems.append(f"ranks planned {sorted(r.rank for r in result.ranks)}, ranks run {sorted(held)}")
    fail_on(problems, f"{subject.name} on {subject.world_size} ranks: the plan against one real step")
