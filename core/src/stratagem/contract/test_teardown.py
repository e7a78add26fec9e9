"""Clean teardown: no process group, child process or listening port left after a run."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract._comparisons import fail_on, section

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_no_process_group_left(contract_run: Any) -> None:
    problems = [
        f"phase {phase}, rank {rank}: expected no process group after teardown(), got one still initialised"
        for phase in (1, 2)
        for rank, data in section(contract_run, phase, "teardown").items()
        if data["process_group_alive"]
    ]
    fail_on(problems, "process group after teardown")


def test_no_child_process_left(contract_run: Any) -> None:
    problems = []
    for phase in (1, 2):
        for rank, data in section(contract_run, phase, "teardown").items():
            if data["children"]:
                problems.append(
                    f"phase {phase}, rank {rank}: expected no child processes, got {data['children']}"
                )
        if contract_run.children_left.get(phase) is None:
            pytest.skip("no /proc here to list child processes")
        if contract_run.children_left[phase]:
            problems.append(
                f"phase {phase}: expected the launcher to leave no child process, got "
                f"{contract_run.children_left[phase]}"
            )
    fail_on(problems, "child processes after teardown")


def test_port_free_after_the_run(contract_run: Any) -> None:
    problems = []
    for phase in (1, 2):
        section(contract_run, phase, "teardown")
        if contract_run.ports_in_use[phase]:
            problems.append(
                f"phase {phase}: expected the master port free after the run, got "
                f"{contract_run.ports_in_use[phase]} still listening"
            )
    fail_on(problems, "ports after teardown")
