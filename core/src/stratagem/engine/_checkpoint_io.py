"""The Engine's checkpoints: saving from every rank (blocking, or in the background with at most one save in
flight), waiting for that save, and loading in place. The strategy's hooks do the work (see
:mod:`stratagem.checkpoint` for the default layouts)."""

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
    from stratagem.registry._manager import StrategyHooks


def _default_format(strategy: Strategy) -> str:
    return getattr(strategy, "checkpoint_format", "full")


class Checkpoints:
    """The Engine's checkpoint methods; the Engine holds the strategy and the save in flight."""

    strategy: Strategy
    capabilities: Any
    _hooks: StrategyHooks
    _pending_save: Any

    def setup_environment(self) -> None:  # the Engine's
        raise NotImplementedError

    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        format: str | None = None,
        *,
        blocking: bool = True,
        _on_published: Callable[[], None] | None = None,
    ) -> None:
        """Save ``state`` from every rank (``format``: ``full`` or ``sharded``; default: the strategy's).

        ``path``: a local path or an object-store URL (``s3://``, ``gs://``, ``az://``, ``memory://``; see
        docs/checkpoints.md). ``blocking=False`` returns before the state is written, and what is written is the
        state at the call: parameters and optimizer state are copied in the background while the next forward
        and backward run (every optimizer's ``step`` waits for that copy), the rest before returning (sharded:
        ``torch.distributed.checkpoint.async_save``; full: rank 0 writes in a background thread). At
        most one save is in flight: the next save, a load, :meth:`wait_for_checkpoint` or :meth:`teardown` waits
        for it and raises its failure, naming the path, on every rank.
        """
        self.setup_environment()
        _store.location(path)  # an unknown URL scheme fails here, on every rank, before any collective
        self.wait_for_checkpoint()
        fmt = format or _default_format(self.strategy)
        caps = self.capabilities
        if caps is not None and fmt not in caps.checkpoint_formats:
            alternatives = [i.name for i in get_registry() if fmt in i.capabilities.checkpoint_formats]
            raise CapabilityError(self.strategy.name, "checkpoint format", fmt, alternatives)
        own_layout = type(self.strategy).save_checkpoint is not Strategy.save_checkpoint
        if blocking or own_layout:
            if not blocking:
                warnings.warn(
                    f"strategy {self.strategy.name!r} writes checkpoints its own way; saving synchronously.",
                    stacklevel=2,
                )
            self._hooks.save_checkpoint(os.fspath(path), _strategy_objects(state), fmt)
            if _on_published is not None:
                _on_published()
            return
        from stratagem.checkpoint import _save

        self._pending_save = _save.save(
            self.strategy,
            os.fspath(path),
            _strategy_objects(state),
            fmt,
            blocking=False,
            on_published=_on_published,
        )

    def checkpoint_in_flight(self) -> bool:
        """True while this rank's part of a ``blocking=False`` save is still being written."""
        return self._pending_save is not None and not self._pending_save.done()

    def wait_for_checkpoint(self) -> None:
        """Wait for the save in flight (``blocking=False``), on every rank; raise its failure with the path."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            from stratagem.checkpoint import _async

            _async.finish(self.strategy, pending)

    def load(
        self, path: str | os.PathLike[str], state: dict[str, Any], strict: bool = True
    ) -> dict[str, Any]:
        """Fill ``state``'s modules, optimizers and stateful objects in place; return the other saved entries."""
        self.setup_environment()
        self.wait_for_checkpoint()
        target = _store.location(path)
        if isinstance(target, Path) and not target.exists() and not _atomic.old_sibling(target).exists():
            raise CheckpointError(target, "does not exist. Pass the path of a checkpoint file or directory.")
        return self._hooks.load_checkpoint(os.fspath(path), _strategy_objects(state), strict)
