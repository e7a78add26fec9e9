"""What a launcher is asked to run (what it declares it can do is
:class:`~stratagem.registry.capabilities.LauncherCapabilities`, re-exported here)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from stratagem.launchers import _preemption_signals
from stratagem.registry.capabilities import LauncherCapabilities

__all__ = ["LaunchJob", "LauncherCapabilities"]


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
    :param preemption_signals: signals that preempt the run: a launcher that receives one passes it on to the
        workers (which save and stop, see ``Trainer(preemption_signals=...)``) and waits for them up to
        ``preemption_grace_s`` seconds; then it ends with :class:`~stratagem.errors.Preempted`.
    :param preemption_grace_s: how long the scheduler leaves between its signal and the kill.
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
    preemption_signals: tuple[str, ...] = attrs.field(
        default=_preemption_signals.DEFAULT_SIGNALS,
        converter=functools.partial(
            _preemption_signals.signal_names, option="LaunchJob(preemption_signals=...)"
        ),
    )
    preemption_grace_s: float = attrs.field(
        default=_preemption_signals.DEFAULT_GRACE_S,
        converter=functools.partial(
            _preemption_signals.check_grace, option="LaunchJob(preemption_grace_s=...)"
        ),
    )

    @property
    def max_nodes(self) -> int:
        text = str(self.nnodes)
        return int(text.partition(":")[2] or text)
