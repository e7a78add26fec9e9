"""Exact resume: k + m steps straight against k steps, save, new processes, load, m steps.

Bit-equal on CPU with deterministic algorithms: losses, parameters and optimizer state.
"""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract import _suite_model as m
from stratagem.contract._comparisons import compare, compare_series, fail_on, section
from stratagem.contract.test_checkpoint import require_format

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_exact_resume(contract_run: Any, fmt: str) -> None:
    require_format(contract_run, fmt)
    first = section(contract_run, 1, "straight")[0]
    then = section(contract_run, 1, "continued")[0]
    resumed = section(contract_run, 2, f"resume_{fmt}")[0]
    k, n = m.STEPS_BEFORE_SAVE, m.STEPS_AFTER_SAVE
    straight_losses = first["losses"] + then["losses"]
    problems = compare_series(
        straight_losses[k:], resumed["losses"], f"losses of steps {k + 1}..{k + n}", None
    )
    if "full" in contract_run.subject.formats:
        final = section(contract_run, 1, "final")[0][""]
        problems += compare(final["params"], resumed["final"]["params"], "final model state")
        problems += compare(final["optimizer"], resumed["final"]["optimizer"], "final optimizer state")
    else:
        problems += compare(then["params"], resumed["final_params"], "final model state")
    fail_on(
        problems,
        f"{k + n} steps straight vs {k} steps, {fmt} checkpoint, new processes, {n} steps (bit-equal expected)",
    )
