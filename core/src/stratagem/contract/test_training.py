"""Training equivalence: the strategy on N ranks against one process on the global batch (float32)."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract import _suite_model as m
from stratagem.contract._comparisons import compare, compare_series, fail_on, section, skip_undeclared

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _straight(run: Any) -> tuple[dict[str, Any], float]:
    subject = run.subject
    if subject.no_training:
        skip_undeclared("precisions", "32-true", subject.no_training)
    if subject.tolerance is None:
        skip_undeclared(
            "contract_tolerance",
            None,
            f"{subject.name} declares contract_tolerance=None: it claims no equivalence with synchronous "
            "training on the global batch",
        )
    first, then = section(run, 1, "straight")[0], section(run, 1, "continued")[0]
    return {
        "losses": first["losses"] + then["losses"],
        "norms": first["norms"] + then["norms"],
        "at_save": first["params"],
        "final": then["params"],
    }, subject.tolerance


def _what(run: Any) -> str:
    s = run.subject
    return (
        f"{s.name} on {s.world_size} rank(s) vs one process on the global batch (tolerance {s.tolerance:g})"
    )


def _params(run: Any, observed: Any, fallback: str, key: str) -> Any:
    """Parameters as the module shows them; for a strategy that partitions them in place, as its own full
    checkpoint holds them."""
    if observed is not None:
        return observed
    if "full" not in run.subject.formats:
        pytest.fail(
            f"{run.subject.name}: named_parameters() shows no values (partitioned in place) and the strategy "
            "declares no full checkpoint to read them from",
            pytrace=False,
        )
    return section(run, 1, fallback)[0][key]["params"]


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


def test_evaluation_matches_the_reference(contract_run: Any) -> None:
    """``Engine.eval_batch`` (forward only: the strategy's own, or the model's) after the first steps."""
    _straight(contract_run)
    evaluated = section(contract_run, 1, "straight")[0]["eval_loss"]
    fail_on(
        compare_series(
            [contract_run.reference["eval_loss"]],
            [evaluated],
            f"loss of each replica's first batch after {m.STEPS_BEFORE_SAVE} steps, forward only",
            contract_run.subject.tolerance,
        ),
        _what(contract_run),
    )


def test_parameters_match_the_reference(contract_run: Any) -> None:
    straight, tolerance = _straight(contract_run)
    reference = contract_run.reference
    problems = compare(
        reference["params_at_save"],
        _params(contract_run, straight["at_save"], "saving", "at_save"),
        f"parameters after {m.STEPS_BEFORE_SAVE} steps",
        tolerance=tolerance,
    )
    problems += compare(
        reference["params_final"],
        _params(contract_run, straight["final"], "final", ""),
        f"parameters after {m.STEPS_BEFORE_SAVE + m.STEPS_AFTER_SAVE} steps",
        tolerance=tolerance,
    )
    fail_on(problems, _what(contract_run))


def test_the_trainer_matches_the_reference(contract_run: Any) -> None:
    """The same training through ``Trainer.fit``, with a step that calls the submodules directly."""
    _, tolerance = _straight(contract_run)
    trained = section(contract_run, 1, "trainer")[0]
    fail_on(
        compare(
            contract_run.reference["params_final"],
            _params(contract_run, trained["params"], "trainer", "full"),
            f"parameters after Trainer.fit of {m.STEPS_BEFORE_SAVE + m.STEPS_AFTER_SAVE} steps",
            tolerance=tolerance,
        ),
        _what(contract_run) + ", through the Trainer",
    )
