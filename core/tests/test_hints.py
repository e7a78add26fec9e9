"""What the core says about a name that is not installed, and what ``strategy="auto"`` picks: both come from what
installed plugins declare (``register_install_hints``, ``Capabilities(auto_priority=...)``), never from names
the core knows. Real distributions on a fresh path, loaded through their entry points."""

from __future__ import annotations

import pytest

from stratagem.errors import (
    CapabilityError,
    ConfigurationError,
    PluginLoadError,
    UnknownLauncherError,
    UnknownNameError,
    UnknownStrategyError,
)
from stratagem.registry._manager import discover

#: Three data-parallel strategies that offer themselves for ``auto``: ``b_first`` and ``a_tied`` with the same
#: priority (a tie, broken by name), ``c_fp32`` with the highest priority but float32 only.
FAMILY = """
    from stratagem import Capabilities, hookimpl

    def caps(priority, precisions=("32-true", "bf16-mixed")):
        return Capabilities(precisions=set(precisions), auto_priority=priority)

    @hookimpl
    def register_strategies(register):
        register("b_first", "acme_impl:S", description="d", capabilities=caps(5))
        register("a_tied", "acme_impl:S", description="d", capabilities=caps(5))
        register("c_fp32", "acme_impl:S", description="d", capabilities=caps(9, ["32-true"]))
        register("not_auto", "acme_impl:S", description="d", capabilities=Capabilities())

    @hookimpl
    def register_install_hints(register):
        register("acme-more", strategies=["acme_zero"], launchers=["acme_cloud"], install="acme-more[cloud]")
        register("acme-logs", loggers=["acme_tracker"])
"""


@pytest.fixture
def acme(make_distribution):
    make_distribution("acme", "1.0", {"acme": "acme_plugin"}, {"acme_plugin": FAMILY})
    return discover(environ={"STRATAGEM_PLUGINS": "acme"})[0]


def test_auto_picks_the_highest_priority_that_serves_the_request(acme) -> None:
    assert acme.auto(world_size=2, accelerator="cpu", precision="32-true").name == "c_fp32"
    # c_fp32 refuses bf16: the next priority, and between equals the first name.
    assert acme.auto(world_size=2, accelerator="cpu", precision="bf16-mixed").name == "a_tied"
    assert acme.auto(world_size=1).name == "single_device"
    # None serves bf16-true: the best candidate all the same, so that the check says what it lacks.
    chosen = acme.auto(world_size=2, accelerator="cpu", precision="bf16-true")
    with pytest.raises(CapabilityError, match="bf16-true"):
        acme.check_request(chosen.name, accelerator="cpu", precision="bf16-true", world_size=2)


def test_a_name_a_plugin_hints_at_says_what_to_install(acme) -> None:
    with pytest.raises(UnknownLauncherError) as launcher:
        acme.get_launcher("acme_cloud")
    assert str(launcher.value) == (
        "Unknown launcher 'acme_cloud'. It comes with acme-more: pip install acme-more[cloud]. "
        "Installed launchers: elastic."
    )
    with pytest.raises(
        UnknownStrategyError, match=r"It comes with acme-more: pip install acme-more\[cloud\]\."
    ):
        acme.get("acme_zero")
    with pytest.raises(UnknownNameError, match=r"It comes with acme-logs: pip install acme-logs\."):
        acme.get_callback("acme_tracker", "logger")


def test_without_a_hint_the_core_names_no_package() -> None:
    registry, _ = discover(environ={"STRATAGEM_PLUGINS": ""})
    messages = []
    for attempt in (
        lambda: registry.get("fsdp"),
        lambda: registry.get_launcher("ray"),
        lambda: registry.auto(world_size=2, accelerator="cpu"),
    ):
        with pytest.raises((KeyError, ConfigurationError)) as caught:
            attempt()
        messages.append(str(caught.value))
    assert "Other strategies come with plugin packages: `stratagem strategies` lists" in messages[0]
    assert "Other launchers come with plugin packages: `stratagem launchers` lists" in messages[1]
    assert "no installed strategy offers itself for 'auto'" in messages[2]
    assert not [m for m in messages if "stratagem-" in m or "pip install" in m], messages
    # A typo still gets the closest name rather than the pointer.
    with pytest.raises(UnknownStrategyError, match="Did you mean 'single_device'") as typo:
        registry.get("single_devise")
    assert "Other strategies" not in str(typo.value)


def test_auto_with_no_candidate_names_the_strategies_that_serve_it(make_distribution) -> None:
    source = FAMILY.replace("caps(5)", "caps(None)").replace("caps(9, ", "caps(None, ")
    make_distribution("acme", "1.0", {"acme": "acme_plugin"}, {"acme_plugin": source})
    registry, _ = discover(environ={"STRATAGEM_PLUGINS": "acme"})
    with pytest.raises(ConfigurationError) as caught:
        registry.auto(world_size=4, accelerator="cpu", precision="32-true")
    assert str(caught.value) == (
        "strategy='auto' with 4 processes: no installed strategy offers itself for 'auto' (a strategy does with "
        "Capabilities(auto_priority=...)). Name a strategy that serves it (a_tied, b_first, c_fp32, not_auto), "
        "or install a strategy plugin: acme-more."
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ('register("x", strategies="abc")', "give a list of names, e.g. strategies=['abc']"),
        ('register("", launchers=["y"])', "name a distribution"),
    ],
)
def test_a_bad_hint_breaks_only_its_plugin_with_the_rule(make_distribution, call: str, message: str) -> None:
    source = f"""
        from stratagem import hookimpl

        @hookimpl
        def register_install_hints(register):
            {call}
    """
    make_distribution("bad-hints", "0.1", {"bad": "bad_hints_plugin"}, {"bad_hints_plugin": source})
    registry, _ = discover(environ={"STRATAGEM_PLUGINS": "bad"})
    [broken] = registry.broken
    assert isinstance(broken, PluginLoadError) and message in str(broken), str(broken)
    assert registry.names() == ["single_device"]


def test_auto_priority_is_a_whole_number_or_none() -> None:
    from stratagem import Capabilities

    assert Capabilities(auto_priority=3).to_json()["auto_priority"] == 3
    for bad in (True, 1.5, "high"):
        with pytest.raises(ValueError, match=r"auto_priority=.*give a whole number, or None"):
            Capabilities(auto_priority=bad)  # type: ignore[arg-type]


def test_the_core_table_of_launcher_packages_is_deprecated_and_empty() -> None:
    from stratagem import errors

    with pytest.warns(
        DeprecationWarning, match=r"KNOWN_LAUNCHER_PACKAGES is deprecated.*register_install_hints"
    ):
        assert errors.KNOWN_LAUNCHER_PACKAGES == {}
    with pytest.raises(AttributeError, match="no attribute 'KNOWN_STRATEGY_PACKAGES'"):
        errors.KNOWN_STRATEGY_PACKAGES  # noqa: B018
