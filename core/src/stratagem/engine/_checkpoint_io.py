"""The Engine's checkpoints: saving from every rank (blocking, or in the background with at most one save in
flight), waiting for that save, and loading in place. The strategy's hooks do the work (see
:mod:`stratagem.checkpoint` for the default layouts); :meth:`stratagem.Engine.save` documents what a caller
gets."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratagem.checkpoint import _atomic, _store
from stratagem.engine._strategy_optimizer import _strategy_objects
from stratagem.errors import CapabilityError, CheckpointError
from stratagem.registry._manager import get_registry
from stratagem.strategies.base import Strategy

if TYPE_CHECKING:
    from stratagem.engine._strategy_runtime import StrategyRuntime


def _default_format(strategy: Strategy) -> str:
    return getattr(strategy, "checkpoint_format", "full")


class CheckpointIO:
    """An Engine's saves and loads through its strategy, and the one save that may be in flight."""

    def __init__(self, runtime: StrategyRuntime) -> None:
        self._runtime = runtime
        self._pending: Any = None  # the blocking=False save still being written

    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        format: str | None,
        *,
        blocking: bool,
        on_published: Callable[[], None] | None,
    ) -> None:
        runtime = self._runtime
        runtime.setup_environment()
        _store.location(path)  # an unknown URL scheme fails here, on every rank, before any collective
        self.wait()
        strategy = runtime.strategy
        fmt = format or _default_format(strategy)
        caps = runtime.capabilities
        if caps is not None and fmt not in caps.checkpoint_formats:
            alternatives = [i.name for i in get_registry() if fmt in i.capabilities.checkpoint_formats]
            raise CapabilityError(strategy.name, "checkpoint format", fmt, alternatives)
        own_layout = type(strategy).save_checkpoint is not Strategy.save_checkpoint
        if blocking or own_layout:
            if not blocking:
                warnings.warn(
                    f"strategy {strategy.name!r} writes checkpoints its own way; saving synchronously.",
                    stacklevel=3,
                )
            runtime.hooks.save_checkpoint(os.fspath(path), _strategy_objects(state), fmt)
            if on_published is not None:
                on_published()
            return
        from stratagem.checkpoint import _save

        self._pending = _save.save(
            strategy,
            os.fspath(path),
            _strategy_objects(state),
            fmt,
            blocking=False,
            on_published=on_published,
        )

    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            from stratagem.checkpoint import _async

            _async.finish(self._runtime.strategy, pending)

    def load(self, path: str | os.PathLike[str], state: dict[str, Any], strict: bool) -> dict[str, Any]:
        self._runtime.setup_environment()
        self.wait()
        target = _store.location(path)
        if isinstance(target, Path) and not target.exists() and not _atomic.old_sibling(target).exists():
            raise CheckpointError(target, "does not exist. Pass the path of a checkpoint file or directory.")
        return self._runtime.hooks.load_checkpoint(os.fspath(path), _strategy_objects(state), strict)

    def close(self) -> None:
        """Before the strategy leaves its process group: the save in flight finished, and what background saving
        holds (its process group, its threads) released."""
        self.wait()
        from stratagem.checkpoint import _async

        _async.release_async_resources(self._runtime.strategy)
