"""The callback section: ``pytest --pyargs stratagem.contract --stratagem-callback NAME`` (or
``--stratagem-logger NAME``; ``stratagem contract --callback NAME``).

A callback or logger registered by name is created as ``Trainer(callbacks=["NAME"])`` creates it, and sits in
real fits on two CPU ranks (see :mod:`stratagem.contract._callback_workloads`): a straight fit with validation,
logging at every step and checkpoints; a fit resumed from the middle one with a new instance; a fit whose step
fails. One launch, shared by these checks.
"""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract._comparisons import compare, fail_on

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _results(run: Any, section: str) -> dict[int, Any]:
    from stratagem.contract._callback_runner import WORLD

    if run.unavailable:
        pytest.skip(run.unavailable)
    if run.launch_error is not None:
        pytest.fail(f"the launch with the {run.kind} {run.name} failed: {run.launch_error}", pytrace=False)
    if sorted(run.results) != list(range(WORLD)):
        pytest.fail(f"expected results from ranks 0..{WORLD - 1}, got {sorted(run.results)}", pytrace=False)
    data = {}
    for rank, result in sorted(run.results.items()):
        if section in result["errors"]:
            pytest.fail(
                f"rank {rank}: the {section} fit with the {run.kind} {run.name} raised:\n{result['errors'][section]}",
                pytrace=False,
            )
        if section not in result:
            pytest.fail(f"rank {rank} returned no {section!r} section (an earlier fit failed)", pytrace=False)
        data[rank] = result[section]
    return data


def test_registered_and_accepted_by_a_trainer(stratagem_event_plugin: str) -> None:
    import importlib_metadata

    from stratagem import hookspecs
    from stratagem.registry._event_hooks import TrainerEventHooks
    from stratagem.registry._manager import get_registry

    kind, _, name = stratagem_event_plugin.partition(":")
    info = get_registry().get_callback(name, kind)
    problems = []
    if not isinstance(info.description, str) or not info.description.strip():
        problems.append(f"description: expected a one-line text, got {info.description!r}")
    try:
        installed = importlib_metadata.version(info.plugin.distribution)
    except importlib_metadata.PackageNotFoundError:
        problems.append(
            f"distribution: expected an installed distribution, got {info.plugin.distribution!r} (register "
            "through an entry point of a pip-installed package)"
        )
    else:
        if installed != info.plugin.version:
            problems.append(f"version: expected {installed!r}, got {info.plugin.version!r}")
    if info.missing_requirements():
        pytest.skip(f"the {kind} {name} requires {', '.join(info.missing_requirements())}, not installed")
    try:
        plugin = info.create()
        events = TrainerEventHooks([(name, plugin)])
    except Exception as error:
        problems.append(
            f"created by name, as Trainer({kind}s=[{name!r}]) does: {type(error).__name__}: {error}"
        )
    else:
        if not events.implemented:
            problems.append(
                f"expected it to implement at least one Trainer event, got none ({type(plugin).__name__})"
            )
        logging_events = {"log_hyperparams", "log_metrics"}
        if kind == "logger" and not events.implemented & logging_events:
            problems.append(
                f"a logger implements log_hyperparams or log_metrics; {type(plugin).__name__} implements "
                f"{sorted(events.implemented)} of {list(hookspecs.TRAINER_EVENTS)}"
            )
    fail_on(problems, f"registration of the {kind} {name!r}")


def test_fit_runs_on_every_rank(event_plugin_run: Any) -> None:
    from stratagem.contract._callback_workloads import STEPS

    straight = _results(event_plugin_run, "straight")
    problems = [
        f"rank {rank}: expected fit to end at step {STEPS}, got {data['step']}"
        for rank, data in straight.items()
        if data["step"] != STEPS
    ]
    fail_on(problems, f"Trainer.fit with the {event_plugin_run.kind} {event_plugin_run.name}")


def test_state_survives_a_resume(event_plugin_run: Any) -> None:
    """A new instance resumed from step 3 ends at step 6 with the state the straight run ended with."""
    straight = _results(event_plugin_run, "straight")
    resumed = _results(event_plugin_run, "resumed")
    problems = []
    for rank in straight:
        problems += compare(
            straight[rank]["state"],
            resumed[rank]["state"],
            f"rank {rank}: state at step 6 (resumed at step 3 vs straight)",
        )
    fail_on(problems, f"what the {event_plugin_run.kind} {event_plugin_run.name} stores in checkpoints")


def test_an_error_in_fit_reaches_the_caller(event_plugin_run: Any) -> None:
    from stratagem.contract._callback_workloads import FAIL_AT_STEP, FAILURE_MESSAGE

    failing = _results(event_plugin_run, "failing")
    problems = [
        f"rank {rank}: expected fit to raise ContractStepFailure({FAILURE_MESSAGE!r}) from step {FAIL_AT_STEP}, "
        f"got {data['raised']}: {data['message']}"
        for rank, data in failing.items()
        if data["raised"] != "ContractStepFailure" or FAILURE_MESSAGE not in data["message"]
    ]
    fail_on(problems, f"an error in a fit with the {event_plugin_run.kind} {event_plugin_run.name}")
