"""Exact resume: k + m steps straight against k steps, save, new processes, load, m steps.

Bit-equal on CPU with deterministic algorithms: losses, parameters and optimizer state.
"""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract.test_checkpoint import require_format
from stratagem.testing import _model as m
from stratagem.testing._checks import compare, compare_series, fail_on, section

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_exact_resume(contract_run: Any, fmt: str) -> None:
    require_format(contract_run, fmt)
    straight = section(contract_run, 1, "straight")[0]
    resumed = section(contract_run, 2, f"resume_{fmt}")[0]
    k, n = m.STEPS_BEFORE_SAVE, m.STEPS_AFTER_SAVE
    problems = compare_series(
        straight["losses"][k:], resumed["losses"], f"losses of steps {k + 1}..{k + n}", None
    )
    problems += compare(straight["final"]["params"], resumed["final"]["params"], "final model state")
    problems += compare(
        straight["final"]["optimizer"], resumed["final"]["optimizer"], "final optimizer state"
    )
    fail_on(
        problems,
        f"{k + n} steps straight vs {k} steps, {fmt} checkpoint, new processes, {n} steps (bit-equal expected)",
    )
