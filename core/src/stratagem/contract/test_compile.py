"""Compile: the straight run's training again with ``compile=`` (``aot_eager``, each block once), in the place
the framework gives compile for this strategy: it matches eager training, Dynamo really compiled, nothing
recompiled after the second step, and checkpoint keys are the plain model's."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract import _suite_model as m
from stratagem.contract._comparisons import compare, compare_series, fail_on, section, skip_undeclared

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _compiled(run: Any) -> dict[str, Any]:
    subject = run.subject
    if not subject.info.capabilities.compile:
        skip_undeclared(
            "compile",
            True,
            f"{subject.name} declares Capabilities(compile=False): a run with compile= is refused before launch",
        )
    if subject.no_training:
        skip_undeclared("precisions", "32-true", subject.no_training)
    return section(run, 1, "compiled")[0]


def _what(run: Any) -> str:
    s = run.subject
    return f"{s.name} on {s.world_size} rank(s), compiled (backend aot_eager, each block once)"


def test_compile_happened(contract_run: Any) -> None:
    compiled = _compiled(contract_run)
    problems = []
    if not compiled["regions"]:
        problems.append("engine.compiled_regions is empty: setup compiled no module")
    if not compiled["frames"] or compiled["frames"][0] < 1:
        problems.append(f"Dynamo compiled no frame in the first step (frames by step: {compiled['frames']})")
    fail_on(problems, _what(contract_run))


def test_no_recompilation_after_the_second_step(contract_run: Any) -> None:
    frames = _compiled(contract_run)["frames"]
    fail_on(
        [f"Dynamo frames compiled by the end of each step: {frames}; expected no new frame after step 2"]
        if len(frames) > 2 and frames[-1] != frames[1]
        else [],
        _what(contract_run),
    )


def test_compiled_training_matches_eager(contract_run: Any) -> None:
    compiled = _compiled(contract_run)
    tolerance = contract_run.subject.tolerance
    if tolerance is None:
        skip_undeclared(
            "contract_tolerance",
            None,
            f"{contract_run.subject.name} declares contract_tolerance=None: it claims no equivalence with "
            "synchronous training on the global batch",
        )
    reference = contract_run.reference
    params = (
        compiled["params"] if compiled["params"] is not None else (compiled.get("full") or {}).get("params")
    )
    if params is None:
        pytest.fail(
            f"{contract_run.subject.name}: the compiled model shows no parameters and no full checkpoint holds "
            "them",
            pytrace=False,
        )
    problems = compare_series(reference["losses"], compiled["losses"], "loss per step", tolerance)
    problems += compare_series(
        reference["norms"], compiled["norms"], "clipped-gradient norm per step", tolerance
    )
    problems += compare(
        reference["params_final"],
        params,
        f"parameters after {m.STEPS_BEFORE_SAVE + m.STEPS_AFTER_SAVE} steps",
        tolerance=tolerance,
    )
    fail_on(
        problems, _what(contract_run) + f" vs one eager process on the global batch (tolerance {tolerance:g})"
    )


def test_checkpoint_keys_are_the_plain_models(contract_run: Any) -> None:
    compiled = _compiled(contract_run)
    if "full" not in contract_run.subject.formats:
        skip_undeclared(
            "checkpoint_formats", "full", "the keys are read from a full checkpoint the strategy writes"
        )
    expected = sorted(m.build_model().state_dict())
    got = compiled["keys"]
    fail_on(
        []
        if got == expected
        else [
            f"keys only in the compiled run's checkpoint: {sorted(set(got) - set(expected))}; missing: "
            f"{sorted(set(expected) - set(got))}"
        ],
        _what(contract_run) + ", full checkpoint keys",
    )
