"""Where one Trainer's run is, held in one object that the Trainer's parts share: the loop advances it,
checkpoints save and restore it, evaluation reads it, and the Trainer's public attributes (``global_step``,
``model``, ``optimizers``, ``should_stop``, ...) read and set it. A resume replaces some of its values (the
position, the options it changes), and every part sees the new ones, since none keeps a copy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.trainer._resume import Position

if TYPE_CHECKING:
    import torch

    from stratagem.trainer._configured_optimizers import Scheduler
    from stratagem.trainer._options import TrainerOptions
    from stratagem.trainer.module import Module


@attrs.define(eq=False)
class RunState:
    """The run's options (a resume may change ``accumulate_grad_batches``), its position, what it trains, and
    what the first epoch after a resume replays."""

    options: TrainerOptions
    position: Position = attrs.Factory(Position)
    #: The user's module, and the model the strategy made of it (wrapped), once set up.
    module: Module | None = None
    model: torch.nn.Module | None = None
    optimizers: list[Any] = attrs.Factory(list)
    lr_schedulers: list[Scheduler] = attrs.Factory(list)
    #: Set on any rank to end ``fit`` (the ranks agree before they stop).
    should_stop: bool = False
    #: The checkpoint the current ``fit`` resumed from, if any.
    ckpt_path: Path | str | None = None
    #: The train loader's per-process batch size (None: no fixed one).
    batch_size: int | None = None
    #: The RNG states as the current epoch began (every checkpoint keeps them, to replay the epoch).
    epoch_rng: dict[str, Any] | None = None
    #: What a checkpoint restored for the first epoch after resuming from it (``rng``, ``epoch_rng``).
    resume: dict[str, Any] | None = None


class Shared:
    """A Trainer attribute that lives in one of its parts: ``model = Shared("_run", doc)`` reads and sets
    ``trainer._run.model`` (``as_`` names the part's attribute when it differs), so that callbacks and users
    see and change what the parts use."""

    def __init__(self, part: str, doc: str, *, as_: str | None = None) -> None:
        self.part, self.name = part, as_
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: object, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)
