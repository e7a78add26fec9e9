"""What a launcher is asked to run, and what a launcher declares it can do."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from stratagem.capabilities import ACCELERATORS


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
        from stratagem.capabilities import _requirement_installed

        return [r for r in self.requires if not _requirement_installed(r)]

    def to_json(self) -> dict[str, Any]:
        return {
            "accelerators": sorted(self.accelerators),
            "multi_node": self.multi_node,
            "starts_all_nodes": self.starts_all_nodes,
            "requires": list(self.requires),
        }


@attrs.frozen(kw_only=True)
class LaunchJob:
    """One launch: a script to re-run in every worker (``command``) or a function to call there.

    :param kind: ``"script"`` or ``"function"``.
    :param command: the executable and its arguments (``[sys.executable, "train.py", ...]``), for a script.
    :param function: called as ``function(*args)`` in every worker, for a function job.
    :param nproc_per_node: workers per node.
    :param nnodes: nodes, or ``"MIN:MAX"`` for elastic membership.
    :param node_rank: this node's index for a static rendezvous (``None``: the launcher decides).
    :param rdzv_endpoint: ``host:port`` where nodes meet (several nodes).
    :param rdzv_configs: launcher-specific rendezvous settings.
    :param accelerator: ``"cpu"`` or ``"cuda"``.
    :param env: extra environment for the workers.
    :param max_restarts: restarts of the whole worker group after a failure.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(("script", "function")))
    command: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    function: Callable[..., Any] | None = None
    args: tuple[Any, ...] = attrs.field(default=(), converter=tuple)
    nproc_per_node: int = 1
    nnodes: int | str = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_configs: Mapping[str, Any] = attrs.field(factory=dict)
    accelerator: str = "cpu"
    env: Mapping[str, str] = attrs.field(factory=dict)
    max_restarts: int = 0

    @property
    def max_nodes(self) -> int:
        text = str(self.nnodes)
        return int(text.partition(":")[2] or text)
