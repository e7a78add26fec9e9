"""Registration: the metadata `stratagem strategies` shows, and hook implementations pluggy will honour."""

from __future__ import annotations

from typing import Any

import pytest

from stratagem.contract._comparisons import fail_on


def _strategy_class(subject: Any) -> type:
    if subject.strategy_class is None:
        pytest.skip(subject.unavailable or f"{subject.name}'s class could not be imported")
    return subject.strategy_class


def test_registration_metadata_is_complete(contract_subject: Any) -> None:
    import importlib_metadata

    from stratagem.registry.capabilities import Capabilities

    info, problems = contract_subject.info, list(contract_subject.declaration_problems)
    if not isinstance(info.description, str) or not info.description.strip():
        problems.append(f"description: expected a one-line text, got {info.description!r}")
    if not isinstance(info.capabilities, Capabilities):
        problems.append(f"capabilities: expected a stratagem.Capabilities, got {info.capabilities!r}")
    elif not info.capabilities.accelerators:
        problems.append("capabilities.accelerators: expected at least one of 'cpu', 'cuda', got none")
    distribution, version = info.plugin.distribution, info.plugin.version
    try:
        installed = importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        problems.append(
            f"distribution: expected an installed distribution name, got {distribution!r} (no such "
            "distribution is installed; register through an entry point of a pip-installed package)"
        )
    else:
        if installed != version:
            problems.append(f"version: expected {installed!r} (installed {distribution}), got {version!r}")
    fail_on(problems, f"registration of {contract_subject.name!r}")


def test_hook_implementations_match_the_specs(contract_subject: Any) -> None:
    from stratagem import hookspecs
    from stratagem.errors import HookImplementationError
    from stratagem.registry._hook_object import check_hook_overrides
    from stratagem.registry._manager import STRATEGY_HOOKS, StrategyHooks
    from stratagem.strategies.base import Strategy

    cls = _strategy_class(contract_subject)
    problems = []
    for klass in cls.__mro__:
        if isinstance(klass, type) and issubclass(klass, Strategy):
            try:
                check_hook_overrides(klass)
            except HookImplementationError as error:
                problems.append(str(error))
    marker = f"{hookspecs.PROJECT_NAME}_impl"
    for hook in sorted(STRATEGY_HOOKS):
        function = getattr(getattr(cls, hook, None), "__func__", getattr(cls, hook, None))
        if function is None or not hasattr(function, marker):
            problems.append(
                f"{cls.__qualname__}.{hook}: expected a method marked @hookimpl, got {function!r}"
            )
    try:
        # pluggy checks every implementation's arguments against the spec when it registers a plugin.
        StrategyHooks(contract_subject.info.create(**contract_subject.options), addons=[])
    except Exception as error:
        problems.append(f"registering an instance with the plugin manager: {type(error).__name__}: {error}")
    fail_on(problems, f"hook implementations of {cls.__module__}.{cls.__qualname__}")


def test_override_without_marker_is_refused(contract_subject: Any) -> None:
    from stratagem.errors import HookImplementationError

    cls = _strategy_class(contract_subject)

    def backward(self: Any, loss: Any, model: Any) -> None:
        loss.backward()

    try:
        type(f"Unmarked{cls.__name__}", (cls,), {"backward": backward, "__module__": __name__})
    except HookImplementationError as error:
        assert "hookimpl" in str(error), f"expected the refusal to name @hookimpl, got: {error}"
        return
    pytest.fail(
        f"subclassing {cls.__qualname__} with an unmarked `backward` override: expected "
        "HookImplementationError at class creation (pluggy would silently keep the inherited hook), got a "
        "class. Does the strategy define __init_subclass__ without calling super()?",
        pytrace=False,
    )
