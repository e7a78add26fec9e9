"""What every rank of a save or a load does together: agreeing that all succeeded (or raising the same error,
naming each failing rank's, everywhere), gathering per-rank values, and the strategy's state-dict conversions.

Every rank calls these at the same points: several are collectives.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from stratagem.checkpoint._state_layout import (
    Parts,
    PerRank,
    check_plain,
    owner_of,
    pack_per_rank,
)
from stratagem.errors import CheckpointError


@attrs.frozen
class Agreement:
    """The end of each phase of a save: every rank leaves a ``with agreement:`` block together, and if the block
    raised on any rank, every rank raises the same CheckpointError, naming each failing rank's error.

    Leaving the block is a collective: every rank enters it, whether it has work there or not. A rank that
    fails skips the rest of its block, so a block holds work that fails alone before any collective of its own.
    """

    strategy: Any
    path: Path | str

    def __enter__(self) -> Agreement:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False  # an interrupt ends this rank here as anywhere else
        _agree(self.strategy, self.path, error)
        return False


def _agree(strategy: Any, path: Path | str, error: BaseException | None) -> None:
    """Raise the same CheckpointError on every rank if any rank failed, naming each failing rank's error.

    Every rank must call this at the same point: it is a collective.
    """
    failed = strategy.all_reduce(torch.tensor([1.0 if error is not None else 0.0]), "max")
    if float(failed[0]) == 0.0:
        return
    if strategy.world_size == 1:
        assert error is not None
        if isinstance(error, CheckpointError) and error.path == str(path):
            raise error
        raise CheckpointError(
            path, f"failed: {_describe(error)}. The previous checkpoint at this path is untouched."
        ) from error
    mine = None if error is None else _describe(error)
    messages = [strategy.broadcast(mine, src) for src in range(strategy.world_size)]
    ranks_of: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message is not None:
            ranks_of.setdefault(message, []).append(rank)
    detail = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in ranks_of.items()
    )
    raise CheckpointError(
        path, f"failed ({detail}). The previous checkpoint at this path is untouched."
    ) from error


def _describe(error: BaseException) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _attempt(function: Any, *args: Any) -> tuple[Any, BaseException | None]:
    """``(result, None)``, or ``(None, error)`` if ``function(*args)`` raised; ``agree`` reports the error."""
    try:
        return function(*args), None
    except Exception as exc:  # reported on every rank by _agree
        return None, exc


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # DCP warns on every single-process call that it assumes a single process; that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _local_state(parts: Parts) -> dict[str, Any]:
    """The stateful objects' state dicts and the plain values, checked; no collective runs here."""
    state = {key: obj.state_dict() for key, obj in parts.stateful.items()}
    state.update(parts.plain)
    for key, value in state.items():
        check_plain(value.value if isinstance(value, PerRank) else value, f"state[{key!r}]")
    return state


def _gather_per_rank(strategy: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each :class:`PerRank` value replaced by every rank's value (a collective)."""
    gathered = {}
    for key, value in state.items():
        if isinstance(value, PerRank):
            values = [strategy.broadcast(value.value, src) for src in range(strategy.world_size)]
            gathered[key] = pack_per_rank(value, values)
        else:
            gathered[key] = value
    return gathered


def _converted(strategy: Any, parts: Parts, full: bool) -> dict[str, Any]:
    return {
        "model": {k: strategy.module_state_dict(m, full=full) for k, m in parts.modules.items()},
        "optimizers": {
            k: strategy.optimizer_state_dict(owner_of(o, parts.modules), o, full=full)
            for k, o in parts.optimizers.items()
        },
    }
