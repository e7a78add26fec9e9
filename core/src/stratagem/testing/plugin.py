"""The pytest plugin registered under ``pytest11``. Inert unless ``--stratagem-strategy`` is given.

It imports nothing heavy: a project's own pytest run pays only for this module.
"""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("stratagem", "stratagem contract suite")
    group.addoption(
        "--stratagem-strategy",
        action="append",
        default=[],
        metavar="NAME",
        help="certify this strategy with `pytest --pyargs stratagem.contract` (repeatable; 'all' for every one)",
    )
