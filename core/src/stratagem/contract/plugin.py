"""The pytest plugin registered under ``pytest11``. Inert unless ``--stratagem-strategy``,
``--stratagem-launcher``, ``--stratagem-callback`` or ``--stratagem-logger`` is given.

It imports nothing heavy: a project's own pytest run pays only for this module. The contract checks live in
``stratagem.contract`` and run with ``pytest --pyargs stratagem.contract --stratagem-strategy NAME`` (a
strategy), ``--stratagem-launcher NAME`` (a launcher: ``stratagem.contract.test_launcher``), or
``--stratagem-callback NAME`` / ``--stratagem-logger NAME`` (``stratagem.contract.test_callback``).
``--stratagem-report FILE`` writes the run's certificate (:mod:`stratagem.contract._certificate_writer`).

Its fixtures ``make_hosts`` and ``stratagem_hosts`` make several hosts on this machine
(:mod:`stratagem.contract.hosts`) for any project's tests of what runs across machines.
"""

from __future__ import annotations

from typing import Any

import pytest

OPTION = "--stratagem-strategy"
LAUNCHER_OPTION = "--stratagem-launcher"
CALLBACK_OPTION = "--stratagem-callback"
LOGGER_OPTION = "--stratagem-logger"
REPORT_OPTION = "--stratagem-report"
SHARE_OPTION = "--stratagem-share-launches"
_NAMES = pytest.StashKey[list]()
_LAUNCHERS = pytest.StashKey[list]()
_RUNS = pytest.StashKey[dict]()
#: ``{"callback": [...], "logger": [...]}``: the callbacks and loggers asked for.
_EVENT_PLUGINS = pytest.StashKey[dict]()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("stratagem", "stratagem contract suite")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="NAME",
        help="certify this strategy with `pytest --pyargs stratagem.contract` (repeatable; 'all' for every one; "
        "NAME[key=value,...] certifies it created with those options)",
    )
    group.addoption(
        SHARE_OPTION,
        action="store_true",
        default=False,
        help="certify the strategies of one world size in the same two launches (each worker runs them in turn): "
        "faster, but a worker that crashes fails all of them",
    )
    group.addoption(
        LAUNCHER_OPTION,
        action="append",
        default=[],
        metavar="NAME",
        help="certify this launcher with `pytest --pyargs stratagem.contract` (repeatable; 'all' for every one)",
    )
    for option, kind in ((CALLBACK_OPTION, "callback"), (LOGGER_OPTION, "logger")):
        group.addoption(
            option,
            action="append",
            default=[],
            metavar="NAME",
            help=f"certify this registered {kind} (repeatable; 'all' for every one)",
        )
    group.addoption(
        REPORT_OPTION,
        default=None,
        metavar="FILE",
        help="write the run's certificate (JSON: versions, declarations, each check's outcome, the verdict)",
    )


def pytest_configure(config: Any) -> None:
    # The suite runs in other projects too, whose settings may be --strict-markers without ours.
    config.addinivalue_line("markers", "multiprocess: starts real worker processes over gloo")
    config.addinivalue_line("markers", "timeout(seconds): fail a test that runs longer (pytest-timeout)")
    config.addinivalue_line(
        "markers", "stratagem_hosts(count=2, local=True): the hosts that the stratagem_hosts fixture gives"
    )
    # Checked now, so that a wrong name is one clear usage error rather than an error per test module.
    config.stash[_NAMES] = selected_strategies(config)
    config.stash[_LAUNCHERS] = selected_launchers(config)
    config.stash[_EVENT_PLUGINS] = {
        "callback": _selected(config, CALLBACK_OPTION, "callback"),
        "logger": _selected(config, LOGGER_OPTION, "logger"),
    }
    report = config.getoption(REPORT_OPTION, None)
    if report:
        from stratagem.contract._certificate_writer import ReportWriter

        config.pluginmanager.register(ReportWriter(report), "stratagem-contract-report")


def selected_strategies(config: Any) -> list[str]:
    """The strategy names asked for, with ``all`` expanded; an unknown name is a usage error."""
    return _selected(config, OPTION, "strategy")


def selected_launchers(config: Any) -> list[str]:
    """The launcher names asked for, with ``all`` expanded; an unknown name is a usage error."""
    return _selected(config, LAUNCHER_OPTION, "launcher")


def _selected(config: Any, option: str, kind: str) -> list[str]:
    from stratagem.registry._labels import parse_label, split_top_level

    # Commas separate names, except inside a strategy's options: fsdp_tp[tensor_parallel_size=2,plan=...].
    requested = [n for value in config.getoption(option) or [] for n in split_top_level(value)]
    if not requested:
        return []
    from stratagem.errors import StratagemError
    from stratagem.registry._manager import get_registry

    registry = get_registry()
    if kind == "strategy":
        every, look_up = registry.names(), registry.get
    elif kind == "launcher":
        every, look_up = sorted(registry.launchers), registry.get_launcher
    else:
        table = registry.callbacks if kind == "callback" else registry.loggers
        every, look_up = sorted(table), lambda name: registry.get_callback(name, kind)
    names: list[str] = []
    for name in requested:
        for resolved in every if name == "all" else [name]:
            try:
                if kind == "strategy":
                    look_up(parse_label(resolved, option)[0])
                else:
                    look_up(resolved)
            except StratagemError as error:
                raise pytest.UsageError(f"{option} {resolved}: {error}") from None
            if resolved not in names:
                names.append(resolved)
    return names


def pytest_generate_tests(metafunc: Any) -> None:
    if "stratagem_strategy" in metafunc.fixturenames:
        names = metafunc.config.stash[_NAMES]
        # Session scope: every check of one strategy shares one pair of launches.
        metafunc.parametrize("stratagem_strategy", names, ids=names, scope="session")
    if "stratagem_launcher" in metafunc.fixturenames:
        names = metafunc.config.stash[_LAUNCHERS]
        metafunc.parametrize("stratagem_launcher", names, ids=names, scope="session")
    if "stratagem_event_plugin" in metafunc.fixturenames:
        # Callbacks and loggers share one section: "callback:NAME" or "logger:NAME".
        found = [
            f"{kind}:{n}" for kind, names in metafunc.config.stash[_EVENT_PLUGINS].items() for n in names
        ]
        ids = [value.replace(":", "-") for value in found]
        metafunc.parametrize("stratagem_event_plugin", found, ids=ids, scope="session")


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    strategies, launchers = config.stash[_NAMES], config.stash[_LAUNCHERS]
    wanted = {"stratagem_strategy": strategies, "stratagem_launcher": launchers}
    wanted["stratagem_event_plugin"] = [n for names in config.stash[_EVENT_PLUGINS].values() for n in names]
    if not any(any(k in getattr(item, "fixturenames", ()) for k in wanted) for item in items):
        return  # not the contract suite: a project's own tests
    if not any(wanted.values()):
        raise pytest.UsageError(
            f"The stratagem contract suite certifies a strategy, a launcher, a callback or a logger: pass "
            f"{OPTION} NAME, {LAUNCHER_OPTION} NAME, {CALLBACK_OPTION} NAME or {LOGGER_OPTION} NAME "
            "(repeatable, or 'all'), e.g. `pytest --pyargs stratagem.contract --stratagem-strategy "
            "single_device`, or run `stratagem contract NAME` / `stratagem contract --launcher NAME`. "
            "`stratagem strategies`, `stratagem launchers` and `stratagem callbacks` list the installed names."
        )
    # Certifying only launchers (or only strategies): the other section's checks are not collected at all,
    # rather than reported as skipped.
    kept, dropped = [], []
    for item in items:
        names = getattr(item, "fixturenames", ())
        if any(key in names and not given for key, given in wanted.items()):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def contract_subject(stratagem_strategy: str) -> Any:
    """What the strategy under test declares (see :class:`stratagem.contract._runner.Subject`)."""
    from stratagem.contract._runner import subject_for

    return subject_for(stratagem_strategy)


@pytest.fixture(scope="session")
def contract_run(contract_subject: Any, tmp_path_factory: Any, request: Any) -> Any:
    """Both worker launches for the strategy under test, run once and shared by every check (and, with
    ``--stratagem-share-launches``, by every strategy asked for at the same world size)."""
    if contract_subject.unavailable:
        pytest.skip(contract_subject.unavailable)
    import re

    from stratagem.contract._runner import run, run_together, subject_for

    config = request.config
    if not config.getoption(SHARE_OPTION):
        label = re.sub(r"[^\w.-]+", "_", contract_subject.name)
        return run(contract_subject, tmp_path_factory.mktemp(f"contract-{label}"))
    runs = config.stash.setdefault(_RUNS, {})
    if contract_subject.name not in runs:
        others = [subject_for(name) for name in config.stash[_NAMES] if name != contract_subject.name]
        group = [contract_subject] + [
            s
            for s in others
            if not s.unavailable and s.world_size == contract_subject.world_size and s.name not in runs
        ]
        directory = tmp_path_factory.mktemp(f"contract-shared-{contract_subject.world_size}")
        runs.update(run_together(group, directory))
    return runs[contract_subject.name]


@pytest.fixture(scope="session")
def launcher_run(stratagem_launcher: str, tmp_path_factory: Any) -> Any:
    """The launcher section's three launches for the launcher under test, made once."""
    from stratagem.contract._launcher_runner import run

    return run(stratagem_launcher, tmp_path_factory.mktemp(f"launcher-{stratagem_launcher}"))


@pytest.fixture(scope="session")
def event_plugin_run(stratagem_event_plugin: str, tmp_path_factory: Any) -> Any:
    """The callback section's launch for the callback or logger under test (``"callback:NAME"``), made once."""
    from stratagem.contract._callback_runner import run

    kind, _, name = stratagem_event_plugin.partition(":")
    return run(kind, name, tmp_path_factory.mktemp(f"{kind}-{name}"))


@pytest.fixture(scope="module")
def make_hosts(tmp_path_factory: Any) -> Any:
    """``make_hosts(count=2, local=True)``: that many hosts on this machine (:class:`stratagem.contract.hosts.Hosts`),
    made once per module and count, and torn down when the module's tests end, whether they passed, failed or
    timed out. A teardown that leaves a namespace or a process behind is an error. Skips, saying why, where
    namespaces cannot be made (not root, not Linux, ``ip`` missing)."""
    from stratagem.contract import hosts

    made: dict[tuple[int, bool], Any] = {}

    def make(count: int = 2, local: bool = True) -> Any:
        if (count, local) not in made:
            try:
                made[count, local] = hosts.Hosts(count, tmp_path_factory.mktemp("hosts"), local=local).start()
            except hosts.HostsUnavailableError as error:
                pytest.skip(str(error))
        return made[count, local]

    yield make
    left = [f"{item}" for group in made.values() for item in group.close()]
    if left:
        pytest.fail("hosts left behind after teardown: " + "; ".join(left), pytrace=False)


@pytest.fixture
def stratagem_hosts(make_hosts: Any, request: Any) -> Any:
    """The module's hosts for one test (two, each with a local folder, unless the test or its module is marked
    ``@pytest.mark.stratagem_hosts(count, local=...)``). A process that the test left on them, other than a
    daemon, fails it (and is killed), and so does a stratagem scratch entry left in a host's local folder
    (removed)."""
    from stratagem.contract.hosts import LeftBehindError

    marker = request.node.get_closest_marker("stratagem_hosts")
    hosts = make_hosts(*marker.args, **marker.kwargs) if marker else make_hosts()
    yield hosts
    try:
        hosts.check()
    except LeftBehindError as error:
        failure = str(error)
    else:
        return
    pytest.fail(failure, pytrace=False)
