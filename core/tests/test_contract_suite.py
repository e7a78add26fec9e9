"""The contract suite itself: it certifies single_device, and each deliberately broken strategy fails the
matching check with a message saying what was expected and what came back.

The broken strategies come from ``contract_fixtures/stratagem_contract_fixtures``, installed for the pytest
run under test as a distribution with a real ``stratagem`` entry point (a ``dist-info`` on its path), so they
go through discovery and the suite exactly as a third-party plugin does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "contract_fixtures"
BROKEN = ["contract_broken_all_reduce", "contract_broken_optimizer_checkpoint", "contract_broken_resume"]
#: A third party's strategy, built from the hook specs and the plugin-authors guide alone.
ZERO = "contract_zero_ddp"
#: A configuration the class refuses: nothing launches, and the registration check says why.
BAD_OPTION = "contract_gradient_averaging[no_such_option=1]"


def _install_fixtures(site: Path) -> dict[str, str]:
    info = site / "stratagem_contract_fixtures-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: stratagem-contract-fixtures\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text("[stratagem]\ncontract_fixtures = stratagem_contract_fixtures\n")
    (info / "RECORD").write_text("")
    path = os.pathsep.join([str(site), str(FIXTURES), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """``{"module::test[id]": (outcome, message)}`` from a JUnit XML report."""
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = "failed" if kind != "skipped" else "skipped"
                message = (element.get("message") or "") + "\n" + (element.text or "")
        outcomes[name] = (outcome, message)
    return outcomes


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """One run of ``stratagem contract`` over single_device and the broken strategies."""
    work = tmp_path_factory.mktemp("contract")
    env = _install_fixtures(work / "site")
    junit = work / "report.xml"
    # The `stratagem` console script, run by this interpreter.
    cli = "import sys; from stratagem.cli import main; sys.exit(main())"
    command = [
        sys.executable,
        "-c",
        cli,
        "contract",
        "single_device",
        ZERO,
        *BROKEN,
        BAD_OPTION,
        "--share-launches",
    ]
    completed = subprocess.run(
        [*command, f"--pytest-args=--junitxml={junit} -q"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert junit.exists(), (
        f"the suite wrote no report; exit {completed.returncode}:\n{completed.stdout[-3000:]}{completed.stderr[-3000:]}"
    )
    assert completed.returncode == 1, f"expected failures (exit 1), got {completed.returncode}"
    return _outcomes(junit)


def _results(report: dict[str, tuple[str, str]], strategy: str) -> dict[str, tuple[str, str]]:
    return {k: v for k, v in report.items() if f"[{strategy}" in k}


def _failed(report: dict[str, tuple[str, str]], strategy: str) -> set[str]:
    return {k.split("[")[0] for k, (outcome, _) in _results(report, strategy).items() if outcome == "failed"}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_single_device_is_certified(report: dict[str, tuple[str, str]]) -> None:
    results = _results(report, "single_device")
    assert len(results) >= 20, sorted(results)
    not_passed = {k: v for k, v in results.items() if v[0] != "passed"}
    assert not not_passed, not_passed


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_wrong_all_reduce_fails_the_all_reduce_check(report: dict[str, tuple[str, str]]) -> None:
    outcome, message = report["test_collectives::test_all_reduce[contract_broken_all_reduce]"]
    assert outcome == "failed"
    assert (
        "all_reduce(op='mean') of [r+1, 2(r+1), -(r+1)] over 2 ranks: expected [1.5, 3.0, -1.5], got [3.0, 6.0, -3.0]"
        in message
    ), message
    assert "op='sum'" not in message and "op='max'" not in message, message
    # The other collectives, checkpoints and resume are intact.
    assert _failed(report, "contract_broken_all_reduce") == {
        "test_collectives::test_all_reduce",
        "test_training::test_losses_match_the_reference",  # losses are reported through all_reduce(mean)
        "test_training::test_the_trainer_matches_the_reference",  # the Trainer reduces its metrics with it
        "test_training::test_evaluation_matches_the_reference",  # so is the evaluation loss
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_strategy_that_declares_it_cannot_compile_skips_the_compile_section(
    report: dict[str, tuple[str, str]],
) -> None:
    from stratagem.contract._comparisons import skipped_declaration

    compile_checks = {
        k: v for k, v in _results(report, "contract_broken_all_reduce").items() if "test_compile" in k
    }
    assert len(compile_checks) == 4, sorted(compile_checks)
    for name, (outcome, message) in compile_checks.items():
        assert outcome == "skipped", (name, message)
        assert skipped_declaration(message.strip()) == ("compile", "True"), message
        assert "declares Capabilities(compile=False)" in message, message


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_checkpoint_without_optimizer_state_fails_the_round_trip(report: dict[str, tuple[str, str]]) -> None:
    name = "contract_broken_optimizer_checkpoint"
    outcome, message = report[f"test_checkpoint::test_round_trip[{name}-full]"]
    assert outcome == "failed"
    assert (
        "expected AdamW state (step, exp_avg, exp_avg_sq) for all 17 parameters after 3 steps, got none for 17"
        in message
    ), message
    outcome, message = report[f"test_checkpoint::test_round_trip[{name}-sharded]"]
    assert outcome == "failed" and "has no optimizer 'optimizer'" in message, message
    # Every check whose checkpoint carries optimizer state, and nothing else.
    assert _failed(report, name) == {
        "test_checkpoint::test_round_trip",
        "test_checkpoint::test_loads_a_full_checkpoint_written_by_single_device",
        "test_resume::test_exact_resume",
    }
    assert all(
        report[f"{check}[{name}{suffix}]"][0] == "failed"
        for check, suffix in (
            ("test_checkpoint::test_round_trip", "-full"),
            ("test_checkpoint::test_round_trip", "-sharded"),
            ("test_resume::test_exact_resume", "-full"),
            ("test_resume::test_exact_resume", "-sharded"),
        )
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_non_exact_resume_fails_only_the_resume_check(report: dict[str, tuple[str, str]]) -> None:
    name = "contract_broken_resume"
    assert _failed(report, name) == {"test_resume::test_exact_resume"}
    for fmt in ("full", "sharded"):
        outcome, message = report[f"test_resume::test_exact_resume[{name}-{fmt}]"]
        assert outcome == "failed"
        assert f"5 steps straight vs 3 steps, {fmt} checkpoint, new processes, 2 steps" in message, message
        assert "final model state: " in message and "expected bit-equal tensor(" in message, message
    # Its declared tolerance (1e-4) applied: equivalence holds, so the checks did run and pass.
    assert report[f"test_training::test_parameters_match_the_reference[{name}]"][0] == "passed"


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_third_party_zero_strategy_written_from_the_hooks_is_certified(
    report: dict[str, tuple[str, str]],
) -> None:
    """DDP + ZeroRedundancyOptimizer, checkpoints customised through the hooks only: everything passes, and
    the only skips are the sharded format it does not declare, named as a structured declaration."""
    from stratagem.contract._comparisons import skipped_declaration

    results = _results(report, ZERO)
    assert len(results) >= 20, sorted(results)
    failed = {k: v for k, v in results.items() if v[0] == "failed"}
    assert not failed, failed
    skipped = {k: skipped_declaration(v[1].strip()) for k, v in results.items() if v[0] == "skipped"}
    assert set(skipped) == {
        f"test_checkpoint::test_round_trip[{ZERO}-sharded]",
        f"test_resume::test_exact_resume[{ZERO}-sharded]",
    }, skipped
    assert set(skipped.values()) == {("checkpoint_formats", "'sharded'")}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_every_hook_is_exercised(report: dict[str, tuple[str, str]]) -> None:
    from stratagem import hookspecs
    from stratagem.contract._recorder import HookRecorder
    from stratagem.registry._manager import (
        DISCOVERY_HOOKS,
        EVENT_HOOKS,
        LAUNCHER_HOOKS,
        PLAN_HOOKS,
        STRATEGY_HOOKS,
    )

    # Every name the partition lists is a spec; whatever is left is a strategy operation, which the
    # recorder below must cover, so a new strategy hook cannot escape the contract suite.
    specs = {n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), f"{hookspecs.PROJECT_NAME}_spec")}
    assert specs == STRATEGY_HOOKS | DISCOVERY_HOOKS | LAUNCHER_HOOKS | EVENT_HOOKS | PLAN_HOOKS
    recorded = {n.removeprefix("record_") for n in dir(HookRecorder) if n.startswith("record_")}
    assert recorded == STRATEGY_HOOKS
    for strategy in ("single_device", ZERO, *BROKEN):
        outcome, message = report[f"test_hooks::test_every_hook_is_exercised[{strategy}]"]
        assert outcome == "passed", message


def _pytest(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plugin_is_inert_without_its_option(tmp_path: Path) -> None:
    (tmp_path / "test_light.py").write_text(
        "import sys\n\ndef test_nothing_heavy_imported():\n"
        "    assert 'torch' not in sys.modules\n    assert 'stratagem.contract._runner' not in sys.modules\n"
    )
    completed = _pytest(["-q", "test_light.py"], tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "1 passed" in completed.stdout
    assert "--stratagem-strategy" in _pytest(["--help"], tmp_path).stdout


def test_suite_without_a_strategy_is_a_usage_error(tmp_path: Path) -> None:
    completed = _pytest(["--pyargs", "stratagem.contract"], tmp_path)
    assert completed.returncode == 4, completed.stdout + completed.stderr
    assert "pass --stratagem-strategy NAME" in completed.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_configuration_the_class_refuses_fails_registration_only(
    report: dict[str, tuple[str, str]],
) -> None:
    results = _results(report, BAD_OPTION)
    assert _failed(report, BAD_OPTION) == {"test_registration::test_registration_metadata_is_complete"}
    failure = next(message for outcome, message in results.values() if outcome == "failed")
    assert "could not be created" in failure and "no_such_option" in failure, failure
    assert all(outcome in ("failed", "skipped") for outcome, _ in results.values()), results


def test_names_with_options_are_read_and_checked_before_anything_runs(tmp_path: Path) -> None:
    for name, message in (
        ("single_devise[x=1]", "Unknown strategy 'single_devise'. Did you mean 'single_device'?"),
        ("single_device[x=1", "cannot read 'single_device[x=1'"),
        ("single_device[a=1,b]", "option 'b' of 'single_device[a=1,b]' needs a value"),
    ):
        completed = _pytest(["--pyargs", "stratagem.contract", "--stratagem-strategy", name], tmp_path)
        assert completed.returncode == 4, completed.stdout + completed.stderr
        assert message in completed.stderr, completed.stderr


def test_unknown_strategy_is_a_usage_error(tmp_path: Path) -> None:
    completed = _pytest(["--pyargs", "stratagem.contract", "--stratagem-strategy", "single_devise"], tmp_path)
    assert completed.returncode == 4, completed.stdout + completed.stderr
    assert "Unknown strategy 'single_devise'. Did you mean 'single_device'?" in completed.stderr
