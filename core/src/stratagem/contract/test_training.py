"""Training equivalence: the strategy on N ranks against one process on the global batch (float32)."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.testing import _model as m
from stratagem.testing._checks import compare, compare_series, fail_on, section

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _straight(run: Any) -> tuple[dict[str, Any], float]:
    subject = run.subject
    if subject.no_training:
        pytest.skip(subject.no_training)
    if subject.tolerance is None:
        pytest.skip(
            f"{subject.name} declares contract_tolerance=None: it claims no equivalence with synchronous "
            "training on the global batch"
        )
    return section(run, 1, "straight")[0], subject.tolerance


def _what(run: Any) -> str:
    s = run.subject
    return (
        f"{s.name} on {s.world_size} rank(s) vs one process on the global batch (tolerance {s.tolerance:g})"
    )


def test_losses_match_the_reference(contract_run: Any) -> None:
    straight, tolerance = _straight(contract_run)
    fail_on(
        compare_series(contract_run.reference["losses"], straight["losses"], "loss per step", tolerance),
        _what(contract_run),
    )


def test_gradient_norms_match_the_reference(contract_run: Any) -> None:
    straight, tolerance = _straight(contract_run)
    fail_on(
        compare_series(
            contract_run.reference["norms"],
            straight["norms"],
            f"clip_gradients(max_norm={m.MAX_NORM}) total norm per step",
            tolerance,
        ),
        _what(contract_run),
    )


def test_parameters_match_the_reference(contract_run: Any) -> None:
    straight, tolerance = _straight(contract_run)
    reference = contract_run.reference
    problems = compare(
        reference["params_at_save"],
        straight["at_save"]["params"],
        f"parameters after {m.STEPS_BEFORE_SAVE} steps",
        tolerance=tolerance,
    )
    problems += compare(
        reference["params_final"],
        straight["final"]["params"],
        f"parameters after {m.STEPS_BEFORE_SAVE + m.STEPS_AFTER_SAVE} steps",
        tolerance=tolerance,
    )
    fail_on(problems, _what(contract_run))
