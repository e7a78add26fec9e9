"""What a strategy or a launcher declares it can do, and the check of a request against it.

Declared, not guessed: the core refuses a request before launching anything, and ``stratagem strategies``
shows the declarations without importing the strategy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

ACCELERATORS = frozenset({"cpu", "cuda"})
PRECISIONS = frozenset({"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"})
CHECKPOINT_FORMATS = frozenset({"full", "sharded"})
#: Precisions that only exist on some accelerators, whatever a strategy declares.
PRECISION_ACCELERATORS = {"16-mixed": frozenset({"cuda"})}


def _frozen_set_of(allowed: frozenset[str], what: str):
    def convert(value: Iterable[str] | str) -> frozenset[str]:
        items = frozenset([value] if isinstance(value, str) else value)
        unknown = sorted(items - allowed)
        if unknown:
            raise ValueError(f"Capabilities: unknown {what} {unknown}; known: {sorted(allowed)}")
        return items

    return convert


def _requirement_installed(requirement: str) -> bool:
    # Checked through package metadata so that listing never imports the package.
    import re

    from stratagem.registry._installed import installed

    return installed(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])


def _optional_int(what: str):
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"Capabilities: {what}={value!r}; give a whole number, or None.")

    return check


@attrs.frozen(kw_only=True)
class Capabilities:
    """The requests a strategy can serve.

    :param accelerators: ``cpu`` and/or ``cuda``.
    :param precisions: precisions the strategy implements; ``16-mixed`` is refused on CPU regardless.
    :param checkpoint_formats: ``full`` (one file every strategy loads) and/or ``sharded`` (a directory).
    :param min_world_size: the fewest processes it runs on.
    :param max_world_size: the most processes it runs on (``None``: no limit).
    :param requires: distributions it needs at run time beyond its own, e.g. ``("deepspeed>=0.14",)``.
    :param compile: whether a run may ask for ``compile=`` (``torch.compile``) with it; ``False`` is refused
        before launch, and the contract suite skips its compile section naming this declaration.
    :param auto_priority: ``strategy="auto"`` with several processes may pick it: the highest priority among the
        installed strategies that serve the request wins (ties by name; stratagem-ddp's ``ddp`` declares 10).
        ``None`` (the default): never picked by ``auto``.
    """

    accelerators: frozenset[str] = attrs.field(
        default=frozenset({"cpu", "cuda"}), converter=_frozen_set_of(ACCELERATORS, "accelerator")
    )
    precisions: frozenset[str] = attrs.field(
        default=frozenset({"32-true"}), converter=_frozen_set_of(PRECISIONS, "precision")
    )
    checkpoint_formats: frozenset[str] = attrs.field(
        default=frozenset({"full"}), converter=_frozen_set_of(CHECKPOINT_FORMATS, "checkpoint format")
    )
    min_world_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_world_size: int | None = attrs.field(default=None)
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    compile: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    auto_priority: int | None = attrs.field(default=None, validator=_optional_int("auto_priority"))

    def __attrs_post_init__(self) -> None:
        if self.max_world_size is not None and self.max_world_size < self.min_world_size:
            raise ValueError(
                f"Capabilities: max_world_size={self.max_world_size} is below min_world_size="
                f"{self.min_world_size}; no world size could run."
            )
        if "full" not in self.checkpoint_formats and "sharded" not in self.checkpoint_formats:
            raise ValueError("Capabilities: declare at least one checkpoint format ('full' or 'sharded').")

    def missing_requirements(self) -> list[str]:
        """The entries of ``requires`` whose distribution is not installed."""
        return [r for r in self.requires if not _requirement_installed(r)]

    def refusal(
        self,
        *,
        accelerator: str | None = None,
        precision: str | None = None,
        world_size: int | None = None,
        checkpoint_format: str | None = None,
    ) -> tuple[str, object] | None:
        """The first capability that a request lacks, as ``(capability, requested value)``, or ``None``."""
        if accelerator is not None and accelerator not in self.accelerators:
            return "accelerator", accelerator
        if precision is not None:
            if precision not in self.precisions:
                return "precision", precision
            only_on = PRECISION_ACCELERATORS.get(precision)
            if accelerator is not None and only_on is not None and accelerator not in only_on:
                return f"precision on {accelerator}", precision
        if world_size is not None and not self.serves_world_size(world_size):
            return "world size", world_size
        if checkpoint_format is not None and checkpoint_format not in self.checkpoint_formats:
            return "checkpoint format", checkpoint_format
        return None

    def serves_world_size(self, world_size: int) -> bool:
        return world_size >= self.min_world_size and (
            self.max_world_size is None or world_size <= self.max_world_size
        )

    def to_json(self) -> dict[str, object]:
        return {
            "accelerators": sorted(self.accelerators),
            "precisions": sorted(self.precisions),
            "checkpoint_formats": sorted(self.checkpoint_formats),
            "world_sizes": [self.min_world_size, self.max_world_size],
            "requires": list(self.requires),
            "compile": self.compile,
            "auto_priority": self.auto_priority,
        }


def _accelerators(value: Iterable[str] | str) -> frozenset[str]:
    items = frozenset([value] if isinstance(value, str) else value)
    unknown = sorted(items - ACCELERATORS)
    if unknown:
        raise ValueError(
            f"LauncherCapabilities: unknown accelerators {unknown}; known: {sorted(ACCELERATORS)}"
        )
    return items


@attrs.frozen(kw_only=True)
class LauncherCapabilities:
    """Checked before anything starts: the accelerators the workers may use, whether a run may span nodes, and
    the distributions the launcher needs (named, never imported, when listing)."""

    accelerators: frozenset[str] = attrs.field(default=ACCELERATORS, converter=_accelerators)
    multi_node: bool = False
    #: One launch from one process starts the workers of every node (Ray); otherwise each node runs its own
    #: launch (torch's elastic agent: ``stratagem run`` on every node).
    starts_all_nodes: bool = False
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def refusal(self, *, accelerator: str, num_nodes: int) -> str | None:
        if accelerator not in self.accelerators:
            return f"accelerator {accelerator!r} (it supports {sorted(self.accelerators)})"
        if num_nodes > 1 and not self.multi_node:
            return f"{num_nodes} nodes (it runs on one node)"
        return None

    def missing_requirements(self) -> list[str]:
        return [r for r in self.requires if not _requirement_installed(r)]

    def to_json(self) -> dict[str, Any]:
        return {
            "accelerators": sorted(self.accelerators),
            "multi_node": self.multi_node,
            "starts_all_nodes": self.starts_all_nodes,
            "requires": list(self.requires),
        }
