"""The launcher section: ``pytest --pyargs stratagem.contract --stratagem-launcher NAME``.

A launcher starts the workers it is asked for with the rank environment, hands back rank 0's result, passes
``job.env`` through, runs script jobs as well as function jobs, and surfaces a worker's exception (its rank,
its message, its traceback) instead of hanging on the peers that wait for it. Three real launches, made once
(see :mod:`stratagem.contract._launcher_runner`) and shared by these checks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from stratagem.contract._comparisons import fail_on

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def _succeeded(launch: Any, what: str) -> Any:
    if launch.error is not None:
        pytest.fail(
            f"{what}: expected the launch to succeed, got {type(launch.error).__name__}: {launch.error}"
        )
    return launch.result


def _rank_environment_problems(workers: list[dict[str, Any]], token: str, world: int) -> list[str]:
    problems = []
    ranks = sorted(int(w["env"]["RANK"]) for w in workers if (w["env"]["RANK"] or "").isdigit())
    if ranks != list(range(world)):
        problems.append(f"expected RANK 0..{world - 1} once each, got {[w['env']['RANK'] for w in workers]}")
    for w in workers:
        env, who = w["env"], f"worker RANK={w['env']['RANK']}"
        for name, value in env.items():
            if value is None:
                problems.append(f"{who}: {name} is not set")
        if env["WORLD_SIZE"] != str(world):
            problems.append(f"{who}: expected WORLD_SIZE={world}, got {env['WORLD_SIZE']}")
        if env["STRATAGEM_WORKER"] != "1":
            problems.append(f"{who}: expected STRATAGEM_WORKER=1, got {env['STRATAGEM_WORKER']}")
        if env["STRATAGEM_CONTRACT_MARKER"] != token:
            problems.append(f"{who}: job.env was not passed through (STRATAGEM_CONTRACT_MARKER)")
        local, local_world = env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]
        if (local or "").isdigit() and (local_world or "").isdigit() and not int(local) < int(local_world):
            problems.append(f"{who}: LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_world}")
    if len({w["pid"] for w in workers}) != len(workers):
        problems.append(f"expected one process per worker, got pids {[w['pid'] for w in workers]}")
    return problems


def test_declares_capabilities(launcher_run: Any) -> None:
    from stratagem.launchers import LauncherCapabilities

    caps = launcher_run.info.capabilities
    assert isinstance(caps, LauncherCapabilities), (
        f"{launcher_run.name}: expected LauncherCapabilities, got {type(caps).__name__}"
    )
    assert "cpu" in caps.accelerators, f"{launcher_run.name} does not declare 'cpu'; the suite runs on CPU"


def test_function_job_gets_rank_environment_and_a_working_group(launcher_run: Any) -> None:
    from stratagem.contract._launcher_runner import WORLD

    results = _succeeded(launcher_run.ok, "a function job on 2 workers")
    assert 0 in results, f"expected rank 0's result among the results, got ranks {sorted(results)}"
    zero = results[0]
    assert zero["token"] == launcher_run.token and zero["rank"] == 0, f"rank 0 returned {zero!r}"
    assert zero["sum"] == WORLD * (WORLD + 1) / 2, (
        f"all_reduce of rank+1 over the group: expected {WORLD * (WORLD + 1) / 2}, got {zero['sum']}"
    )
    fail_on(_rank_environment_problems(zero["workers"], launcher_run.token, WORLD), "rank environment")


def test_script_job_runs_in_every_worker(launcher_run: Any) -> None:
    from stratagem.contract._launcher_runner import WORLD

    _succeeded(launcher_run.script, "a script job (python -m ...) on 2 workers")
    files = sorted(launcher_run.script_dir.glob("rank-*.json"))
    workers = [json.loads(f.read_text()) for f in files]
    assert len(workers) == WORLD, (
        f"expected {WORLD} workers to run the script, found {[f.name for f in files]}"
    )
    fail_on(_rank_environment_problems(workers, launcher_run.token, WORLD), "rank environment (script job)")


def test_worker_exception_names_its_rank_and_does_not_hang(launcher_run: Any) -> None:
    from stratagem.contract._launcher_workloads import COLLECTIVE_TIMEOUT_S
    from stratagem.errors import WorkerFailedError

    error = launcher_run.failing.error
    assert error is not None, f"rank 1 raised, yet the launch returned {launcher_run.failing.result!r}"
    assert isinstance(error, WorkerFailedError), (
        f"expected stratagem.WorkerFailedError, got {type(error).__name__}: {error}"
    )
    assert error.rank == 1, f"expected the failure to name rank 1, got rank {error.rank}: {error}"
    message = str(error)
    assert f"rank 1 fails on purpose ({launcher_run.token})" in message and "ValueError" in message, (
        f"expected the worker's exception in the error, got: {message}"
    )
    assert "Traceback" in message and "fail_on_rank_one" in message, (
        f"expected the worker's traceback in the error, got: {message}"
    )
    # The peer waited in a barrier for rank 1: a launcher that waits for every worker to end by itself would
    # take the collective timeout.
    assert launcher_run.failing.seconds < COLLECTIVE_TIMEOUT_S, (
        f"the failed launch took {launcher_run.failing.seconds:.0f} s: the launcher waited for the peers of "
        "the failed worker instead of stopping them"
    )
