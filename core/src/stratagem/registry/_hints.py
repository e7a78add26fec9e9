"""What the core says when a name is missing, and what ``strategy="auto"`` picks, from what plugins declare.

The core names no plugin package and no strategy of a plugin: a plugin says which distribution provides the
names of its siblings (``register_install_hints``), and a strategy says that ``auto`` may pick it, with a
priority (``Capabilities(auto_priority=...)``). With no plugin installed, the core says what it can without
naming a package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    from stratagem.registry._registry import PluginInfo, StrategyInfo

KINDS = ("strategy", "launcher", "callback", "logger")
_PLURAL = {"strategy": "strategies", "launcher": "launchers", "callback": "callbacks", "logger": "loggers"}


@attrs.frozen
class InstallHint:
    """``name`` (a strategy, launcher, callback or logger) comes with ``distribution``; ``declared_by`` said so."""

    kind: str
    name: str
    distribution: str
    install: str
    declared_by: str


@attrs.define
class InstallHints:
    """Every hint the installed plugins declared, by kind and name."""

    by_name: dict[tuple[str, str], list[InstallHint]] = attrs.field(factory=dict)

    def registrar(self, plugin: PluginInfo) -> Callable[..., None]:
        """The ``register`` callback handed to one plugin's ``register_install_hints``."""

        def register(
            distribution: str,
            *,
            strategies: Iterable[str] = (),
            launchers: Iterable[str] = (),
            callbacks: Iterable[str] = (),
            loggers: Iterable[str] = (),
            install: str | None = None,
        ) -> None:
            if not isinstance(distribution, str) or not distribution:
                raise ValueError(f"register_install_hints: register({distribution!r}): name a distribution.")
            for kind, names in zip(KINDS, (strategies, launchers, callbacks, loggers)):
                if isinstance(names, str):
                    raise TypeError(
                        f"register_install_hints: register({distribution!r}, {_PLURAL[kind]}={names!r}): give a "
                        f"list of names, e.g. {_PLURAL[kind]}=[{names!r}]."
                    )
                for name in names:
                    hint = InstallHint(kind, name, distribution, install or distribution, plugin.distribution)
                    found = self.by_name.setdefault((kind, name), [])
                    if all(h.distribution != distribution for h in found):
                        found.append(hint)

        return register

    def sentence(self, kind: str, name: str) -> str:
        """What to pip install for the ``kind`` ``name``, which is not installed (``""``: no plugin said)."""
        found = self.by_name.get((kind, name), [])
        return " ".join(f"It comes with {h.distribution}: pip install {h.install}." for h in found)

    def distributions(self, kind: str) -> list[str]:
        """The distributions that hints say provide names of ``kind``, sorted."""
        return sorted({h.distribution for (k, _), hints in self.by_name.items() if k == kind for h in hints})


def auto_strategy(
    strategies: Iterable[StrategyInfo], hints: InstallHints, *, world_size: int, **request: Any
) -> StrategyInfo:
    """The strategy ``strategy="auto"`` means with ``world_size`` processes (more than one; a single process
    runs the core's ``single_device``): among the strategies that declare an ``auto_priority``, the highest
    priority of those that serve the request (``accelerator``, ``precision``), ties broken by name. When none
    serves it, the best candidate all the same, so that the capability check names what it lacks."""
    everything = list(strategies)
    candidates = [info for info in everything if info.capabilities.auto_priority is not None]

    def rank(info: StrategyInfo) -> tuple[bool, int, str]:
        serves = info.capabilities.refusal(world_size=world_size, **request) is None
        return (not serves, -info.capabilities.auto_priority, info.name)  # type: ignore[operator]

    if candidates:
        return min(candidates, key=rank)
    able = sorted(
        i.name for i in everything if i.capabilities.refusal(world_size=world_size, **request) is None
    )
    offered = hints.distributions("strategy")
    what = f"Name a strategy that serves it ({', '.join(able)}), or install" if able else "Install"
    where = (
        f": {', '.join(offered)}"
        if offered
        else " (`stratagem strategies` lists what is installed; stratagem's documentation lists the plugin packages)"
    )
    raise ConfigurationError(
        f"strategy='auto' with {world_size} processes: no installed strategy offers itself for 'auto' (a strategy "
        f"does with Capabilities(auto_priority=...)). {what} a strategy plugin{where}."
    )
