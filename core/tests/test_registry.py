"""Discovery through real entry points of distributions written on disk, with a fresh registry per test."""

from __future__ import annotations

import re
import sys

import pytest

from stratagem import Capabilities, Engine, hookimpl
from stratagem.errors import (
    CapabilityError,
    ConfigurationError,
    MissingDependencyError,
    PluginLoadError,
    StrategyConflictError,
    UnknownStrategyError,
)
from stratagem.registry._manager import discover, get_registry

GOOD_PLUGIN = """
    from stratagem import Capabilities, hookimpl

    @hookimpl
    def register_strategies(register):
        register(
            "alpha",
            "alpha_strategies.impl:AlphaStrategy",
            description="Alpha test strategy",
            capabilities=Capabilities(accelerators={"cpu"}, precisions={"32-true"}, checkpoint_formats={"full"}),
        )
        register(
            "alpha_fast",
            "alpha_strategies.impl:AlphaStrategy",
            description="Alpha with a preset",
            capabilities=Capabilities(accelerators={"cpu"}, precisions={"32-true", "bf16-mixed"}),
            speed=2,
        )
"""

GOOD_IMPL = """
    from stratagem.strategies import Strategy

    IMPORTED = True

    class AlphaStrategy(Strategy):
        def __init__(self, speed=1):
            super().__init__()
            self.speed = speed
"""


def install_alpha(make_distribution) -> None:
    """The well-behaved test plugin: two strategies from one lazily imported module."""
    make_distribution(
        "alpha-strategies",
        "1.2.3",
        {"alpha": "alpha_strategies.plugin"},
        {
            "alpha_strategies.__init__": "",
            "alpha_strategies.plugin": GOOD_PLUGIN,
            "alpha_strategies.impl": GOOD_IMPL,
        },
    )


def _env(*names: str) -> dict[str, str]:
    return {"STRATAGEM_PLUGINS": ",".join(names)}


def test_builtin_single_device_is_always_there():
    registry, _ = discover(environ=_env())
    assert registry.names() == ["single_device"]
    info = registry.get("single_device")
    assert info.plugin.distribution == "stratagem"
    assert info.capabilities.max_world_size == 1


def test_installed_plugin_adds_strategies_and_factory_stays_lazy(make_distribution):
    install_alpha(make_distribution)
    registry, _ = discover(environ=_env("alpha"))
    assert registry.names() == ["alpha", "alpha_fast", "single_device"]
    info = registry.get("alpha_fast")
    assert (info.plugin.distribution, info.plugin.version, info.plugin.name) == (
        "alpha-strategies",
        "1.2.3",
        "alpha",
    )
    assert info.preset_options == {"speed": 2}
    # Listing loaded the tiny entry-point module only, never the strategy's module.
    assert "alpha_strategies.plugin" in sys.modules
    assert "alpha_strategies.impl" not in sys.modules
    strategy = info.create()
    assert "alpha_strategies.impl" in sys.modules
    assert (type(strategy).__name__, strategy.speed, strategy.registered_name) == (
        "AlphaStrategy",
        2,
        "alpha_fast",
    )
    assert info.create(speed=5).speed == 5


def test_unknown_name_lists_installed_and_closest():
    registry, _ = discover(environ=_env())
    with pytest.raises(UnknownStrategyError) as caught:
        registry.get("single_devise")
    error = caught.value
    assert isinstance(error, KeyError)
    assert error.closest == "single_device"
    assert "Did you mean 'single_device'?" in str(error)
    assert "Installed strategies: single_device" in str(error)


def test_broken_plugin_is_isolated_and_reported(make_distribution):
    make_distribution(
        "broken-strategies",
        "0.0.1",
        {"broken": "broken_strategies"},
        {"broken_strategies": "import no_such_module_x\n"},
    )
    install_alpha(make_distribution)
    registry, _ = discover(environ=_env("broken", "alpha"))
    assert "alpha" in registry
    [broken] = registry.broken
    assert isinstance(broken, PluginLoadError)
    text = str(broken)
    assert 'Error importing plugin "broken = broken_strategies"' in text
    assert "broken-strategies 0.0.1" in text and "no_such_module_x" in text
    with pytest.raises(UnknownStrategyError, match="Plugins that failed to load: broken"):
        registry.get("broken_thing")


def test_plugin_whose_register_raises_is_isolated(make_distribution):
    source = """
        from stratagem import hookimpl

        @hookimpl
        def register_strategies(register):
            register("half", "x.y:Z", description="registered before the failure")
            raise RuntimeError("boom in register")
    """
    make_distribution("raising", "2.0", {"raising": "raising_plugin"}, {"raising_plugin": source})
    registry, _ = discover(environ=_env("raising"))
    [broken] = registry.broken
    assert "RuntimeError: boom in register" in str(broken)


def test_bad_registration_fails_with_the_rule(make_distribution):
    source = """
        from stratagem import hookimpl

        @hookimpl
        def register_strategies(register):
            register("Bad Name", "x.y:Z", description="d")
    """
    make_distribution("badname", "1.0", {"badname": "badname_plugin"}, {"badname_plugin": source})
    registry, _ = discover(environ=_env("badname"))
    assert "lower-case letters, digits and underscores" in str(registry.broken[0])


def test_conflict_names_both_distributions(make_distribution):
    plugin = """
        from stratagem import hookimpl

        @hookimpl
        def register_strategies(register):
            register("shared_name", "x.y:Z", description="from {dist}")
            register("{dist}_own", "x.y:Z", description="only mine")
    """
    make_distribution(
        "first-dist", "1.0", {"first": "first_plugin"}, {"first_plugin": plugin.format(dist="first")}
    )
    make_distribution(
        "second-dist", "1.0", {"second": "second_plugin"}, {"second_plugin": plugin.format(dist="second")}
    )
    registry, _ = discover(environ=_env("first", "second"))
    with pytest.raises(StrategyConflictError) as caught:
        registry.get("shared_name")
    assert set(caught.value.distributions) == {"first-dist", "second-dist"}
    assert "first-dist" in str(caught.value) and "second-dist" in str(caught.value)
    # The conflict spoils only the shared name.
    assert {"first_own", "second_own"} <= set(registry.names())


def test_allow_list_restricts_loading(make_distribution):
    install_alpha(make_distribution)
    make_distribution(
        "broken-strategies", "0.0.1", {"broken": "broken_strategies"}, {"broken_strategies": "1/0\n"}
    )
    only_alpha, _ = discover(environ=_env("alpha"))
    assert "alpha" in only_alpha and not only_alpha.broken
    none, _ = discover(environ=_env())
    assert none.names() == ["single_device"] and not none.broken
    everything, _ = discover(environ={})
    assert "alpha" in everything and any("broken" in b.entry_point for b in everything.broken)


def test_capability_refusal_names_strategy_capability_and_alternatives(make_distribution):
    install_alpha(make_distribution)
    registry, _ = discover(environ=_env("alpha"))
    with pytest.raises(CapabilityError) as caught:
        registry.check_request("alpha", accelerator="cpu", precision="bf16-mixed")
    error = caught.value
    assert (error.strategy, error.capability, error.requested) == ("alpha", "precision", "bf16-mixed")
    assert error.alternatives == ["alpha_fast", "single_device"]
    with pytest.raises(CapabilityError, match="precision on cpu '16-mixed'"):
        registry.check_request("single_device", accelerator="cpu", precision="16-mixed")
    with pytest.raises(CapabilityError, match="world size 2"):
        registry.check_request("single_device", world_size=2)
    with pytest.raises(
        CapabilityError, match=r"checkpoint format 'sharded'.*Strategies that do: single_device"
    ):
        registry.check_request("alpha", checkpoint_format="sharded")


def test_missing_optional_dependency_lists_and_refuses_before_launch(make_distribution):
    source = """
        from stratagem import Capabilities, hookimpl

        @hookimpl
        def register_strategies(register):
            register("needs_it", "needs_plugin_impl:S", description="needs a package",
                     capabilities=Capabilities(requires=("surely-not-installed-pkg>=1.0",)))
    """
    make_distribution("needs", "1.0", {"needs": "needs_plugin"}, {"needs_plugin": source})
    registry, _ = discover(environ=_env("needs"))
    info = registry.get("needs_it")
    assert info.to_json()["missing"] == ["surely-not-installed-pkg>=1.0"]
    with pytest.raises(
        MissingDependencyError, match=re.escape("pip install 'surely-not-installed-pkg>=1.0'")
    ):
        registry.check_request("needs_it", accelerator="cpu")


def test_engine_refuses_before_launching(monkeypatch):
    monkeypatch.setenv("STRATAGEM_PLUGINS", "")
    get_registry(refresh=True)
    with pytest.raises(CapabilityError, match="16-mixed"):
        Engine(strategy="single_device", accelerator="cpu", precision="16-mixed")
    with pytest.raises(UnknownStrategyError, match="single_device"):
        Engine(strategy="singel_device", accelerator="cpu")
    # With no plugin, 'auto' for several processes has nothing to pick, and the core names no package.
    with pytest.raises(ConfigurationError, match=r"no installed strategy offers itself for 'auto'") as caught:
        Engine(strategy="auto", accelerator="cpu", devices=2)
    assert "stratagem strategies" in str(caught.value) and "stratagem-" not in str(caught.value)


def test_addon_plugin_may_only_wrap_strategy_operations():
    from stratagem.errors import HookImplementationError
    from stratagem.registry._manager import StrategyHooks
    from stratagem.strategies import SingleDeviceStrategy

    class Wrapper:
        calls: list[str] = []

        @hookimpl(wrapper=True)
        def barrier(self, name):
            self.calls.append(name)
            return (yield)

    hooks = StrategyHooks(SingleDeviceStrategy(), addons=[Wrapper()])
    hooks.barrier("here")
    assert Wrapper.calls == ["here"]

    class Hijacker:
        @hookimpl
        def backward(self, loss, model):
            return None

    with pytest.raises(HookImplementationError, match="'backward' as a plain hook"):
        StrategyHooks(SingleDeviceStrategy(), addons=[Hijacker()])


def test_capabilities_validate_their_fields():
    with pytest.raises(ValueError, match="unknown precision"):
        Capabilities(precisions={"fp8"})
    with pytest.raises(ValueError, match="max_world_size=1 is below min_world_size=2"):
        Capabilities(min_world_size=2, max_world_size=1)
