"""The pytest plugin registered under ``pytest11``. Inert unless ``--stratagem-strategy`` is given.

It imports nothing heavy: a project's own pytest run pays only for this module. The contract checks live in
``stratagem.contract`` and run with ``pytest --pyargs stratagem.contract --stratagem-strategy NAME``.
"""

from __future__ import annotations

from typing import Any

import pytest

OPTION = "--stratagem-strategy"
_NAMES = pytest.StashKey[list]()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("stratagem", "stratagem contract suite")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="NAME",
        help="certify this strategy with `pytest --pyargs stratagem.contract` (repeatable; 'all' for every one)",
    )


def pytest_configure(config: Any) -> None:
    # The suite runs in other projects too, whose settings may be --strict-markers without ours.
    config.addinivalue_line("markers", "multiprocess: starts real worker processes over gloo")
    config.addinivalue_line("markers", "timeout(seconds): fail a test that runs longer (pytest-timeout)")
    # Checked now, so that a wrong name is one clear usage error rather than an error per test module.
    config.stash[_NAMES] = selected_strategies(config)


def selected_strategies(config: Any) -> list[str]:
    """The strategy names asked for, with ``all`` expanded; an unknown name is a usage error."""
    requested = [n.strip() for value in config.getoption(OPTION) or [] for n in value.split(",") if n.strip()]
    if not requested:
        return []
    from stratagem._manager import get_registry
    from stratagem.errors import StratagemError

    registry = get_registry()
    names: list[str] = []
    for name in requested:
        for resolved in registry.names() if name == "all" else [name]:
            try:
                registry.get(resolved)
            except StratagemError as error:
                raise pytest.UsageError(f"{OPTION} {resolved}: {error}") from None
            if resolved not in names:
                names.append(resolved)
    return names


def pytest_generate_tests(metafunc: Any) -> None:
    if "stratagem_strategy" in metafunc.fixturenames:
        names = metafunc.config.stash[_NAMES]
        # Session scope: every check of one strategy shares one pair of launches.
        metafunc.parametrize("stratagem_strategy", names, ids=names, scope="session")


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    wants = [item for item in items if "stratagem_strategy" in getattr(item, "fixturenames", ())]
    if wants and not config.getoption(OPTION):
        raise pytest.UsageError(
            f"The stratagem contract suite certifies a strategy: pass {OPTION} NAME (repeatable, or 'all'), "
            "e.g. `pytest --pyargs stratagem.contract --stratagem-strategy single_device`, or run "
            "`stratagem contract NAME`. `stratagem strategies` lists the installed names."
        )


@pytest.fixture(scope="session")
def contract_subject(stratagem_strategy: str) -> Any:
    """What the strategy under test declares (see :class:`stratagem.testing._runner.Subject`)."""
    from stratagem.testing._runner import subject_for

    return subject_for(stratagem_strategy)


@pytest.fixture(scope="session")
def contract_run(contract_subject: Any, tmp_path_factory: Any) -> Any:
    """Both worker launches for the strategy under test, run once and shared by every check."""
    if contract_subject.unavailable:
        pytest.skip(contract_subject.unavailable)
    from stratagem.testing._runner import run

    return run(contract_subject, tmp_path_factory.mktemp(f"contract-{contract_subject.name}"))
