"""What every test module of the repository shares: no torch.distributed process group outlives the module that
made it.

A default process group left in pytest's process changes what later tests do: DCP, for one, gathers each rank's
errors through it (pickled) even at world size 1, so a test that passes alone can fail after another. When a
module's last test has torn down (module fixtures included) and a default group is still initialised, it is
destroyed, and the module is named in a warning and in the session's summary, to be fixed where it was made.

With ``-n 2`` (pytest-xdist, as the README's test command runs), the work goes in two lanes. Every module that
starts worker processes, or holds something of the machine's own (the SLURM cluster of plugins/slurm, network
namespaces by name), goes to one lane, ``serial``, whose modules run one after another on one worker as they
would without xdist: two gloo jobs, clusters or host sets never share the cores or the names. Every other
module is a group of its own, handed whole to whichever worker is free (its module fixtures made once), and the
documentation's modules one group (they share the built site). A multi-process module leaves about half of the
two cores idle (waiting on its peers, its steps' pacing, its timeouts), which the other lane fills.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent
_LEFT_BEHIND: list[str] = []

#: Modules that run in the serial lane though none of their tests is marked ``multiprocess``: they hold a
#: machine-wide resource (plugins/slurm's session cluster; test_hosts' network namespaces).
SERIAL_MODULES = ("plugins/slurm/tests/", "core/tests/test_hosts.py")
#: Modules that share a session fixture (the documentation site, built once) and so go to one worker together.
SHARED_GROUPS = {"tests/test_docs.py": "docs", "tests/test_docs_browser.py": "docs"}


def _module_of(item: pytest.Item | None) -> str | None:
    return None if item is None else item.nodeid.split("::", 1)[0]


def _serial(module: str) -> bool:
    """Whether a module (its path from the repository's root) runs in the serial lane: it marks tests
    ``multiprocess`` or ``cluster`` (the scheduler sees node ids only, so this reads the module's source; every
    worker checks it against the markers it collects), or it is one of SERIAL_MODULES."""
    if module.startswith(SERIAL_MODULES):
        return True
    text = (ROOT / module).read_text()
    return "mark.multiprocess" in text or "mark.cluster" in text


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n``: the two lanes of the module's docstring, on top of xdist's distribution by file."""
    from xdist.scheduler import LoadFileScheduling

    if config.getoption("dist") != "loadfile":
        return None
    serial = functools.lru_cache(maxsize=None)(_serial)

    class Lanes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "serial" if serial(module) else SHARED_GROUPS.get(module, module)

    return Lanes(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: every test marked ``multiprocess`` or ``cluster`` is in a module the scheduler puts
    in the serial lane (a marker given some other way than in the module's source would slip past it)."""
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        module = _module_of(item) or item.nodeid
        marked = item.get_closest_marker("multiprocess") or item.get_closest_marker("cluster")
        if marked and not _serial(module):
            raise pytest.UsageError(
                f"{item.nodeid} is marked {marked.name} but its module does not say so in its source (as "
                f"`pytest.mark.{marked.name}`): conftest.py would run it beside other multi-process modules"
            )


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
