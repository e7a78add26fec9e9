"""What every test module of the repository shares: no torch.distributed process group outlives the module that
made it.

A default process group left in pytest's process changes what later tests do: DCP, for one, gathers each rank's
errors through it (pickled) even at world size 1, so a test that passes alone can fail after another. When a
module's last test has torn down (module fixtures included) and a default group is still initialised, it is
destroyed, and the module is named in a warning and in the session's summary, to be fixed where it was made.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator

import pytest

_LEFT_BEHIND: list[str] = []


def _module_of(item: pytest.Item | None) -> str | None:
    return None if item is None else item.nodeid.split("::", 1)[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    # Only once the module's fixtures are gone: a module may hold a group across its own tests on purpose.
    if _module_of(nextitem) == _module_of(item):
        return result
    dist = sys.modules.get("torch.distributed")  # never import torch for a module that did not
    if dist is not None and dist.is_available() and dist.is_initialized():
        module = _module_of(item) or item.nodeid
        _LEFT_BEHIND.append(module)
        dist.destroy_process_group()
        warnings.warn(
            f"{module} left a torch.distributed process group initialised in pytest's process; destroyed it",
            stacklevel=1,
        )
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFT_BEHIND:
        terminalreporter.section("process groups left behind")
        for module in _LEFT_BEHIND:
            terminalreporter.write_line(
                f"{module}: left a default process group initialised (destroyed after it)"
            )
