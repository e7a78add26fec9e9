"""``ModelCheckpoint``: keep the best k checkpoints by a metric, plus ``last``, through the Trainer's (atomic)
saves."""

from __future__ import annotations

import math
import re
from typing import Any

from stratagem.callbacks._monitored_metric import check_mode, monitored_value
from stratagem.checkpoint import _store
from stratagem.errors import ConfigurationError
from stratagem.hookspecs import hookimpl

_UNSAFE = re.compile(r"[^\w.\-]")


class ModelCheckpoint:
    """Save a checkpoint at each check and keep the ``save_top_k`` best by ``monitor``, plus the newest, which
    ``checkpoints/last`` names (so ``fit(ckpt_path="last")`` resumes from it).

    A check runs after each validation, or every ``every_n_steps`` optimizer steps when that is given (then the
    value is the latest logged one). Without ``monitor`` the newest ``save_top_k`` are kept. Every save is the
    Trainer's: atomic, on every rank; an evicted checkpoint is deleted only after the new one and the ``last``
    pointer are in place. The ranking goes into checkpoints and comes back on resume.

    :param monitor: a metric logged with ``self.log``; ``None`` ranks by step (newest best).
    :param mode: ``"min"`` or ``"max"``.
    :param save_top_k: how many of the best to keep.
    :param every_n_steps: check every this many optimizer steps instead of after each validation.
    :param dirpath: where they go (default: the Trainer's ``checkpoint_dir``).
    :param format: ``"full"`` or ``"sharded"`` (default: the Trainer's).
    """

    def __init__(
        self,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        every_n_steps: int | None = None,
        dirpath: Any = None,
        format: str | None = None,
    ) -> None:
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < 1:
            raise ConfigurationError(f"ModelCheckpoint(save_top_k={save_top_k!r}): give a positive integer.")
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ConfigurationError(
                f"ModelCheckpoint(every_n_steps={every_n_steps!r}): give a positive integer or None."
            )
        if format not in (None, "full", "sharded"):
            raise ConfigurationError(f"ModelCheckpoint(format={format!r}): use 'full', 'sharded' or None.")
        self.monitor = monitor
        self.mode = check_mode("ModelCheckpoint", mode)
        self.save_top_k = save_top_k
        self.every_n_steps = every_n_steps
        self.dirpath = None if dirpath is None else _store.location(dirpath)
        self.format = format
        self.state_key = f"ModelCheckpoint[{monitor}]" if monitor else "ModelCheckpoint"
        #: ``[name, score, step]`` of the kept best, best first.
        self.best: list[list[Any]] = []
        #: The newest checkpoint's name.
        self.last: str | None = None
        self._checked_step: int | None = None
        self._directory: Any = self.dirpath

    def best_checkpoint(self, trainer: Any) -> Any:
        """The best checkpoint kept so far, or ``None``: what ``trainer.test(ckpt_path="best")`` loads."""
        if not self.best:
            return None
        directory = self.dirpath if self.dirpath is not None else trainer.checkpoint_dir
        return _store.join(directory, self.best[0][0])

    @property
    def best_model_path(self) -> str | None:
        """The best checkpoint's path once this callback has saved or resumed in a run, else ``None``."""
        if not self.best or self._directory is None:
            return None
        return str(_store.join(self._directory, self.best[0][0]))

    # events ----------------------------------------------------------------------------------------
    @hookimpl
    def on_validation_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self.every_n_steps is None:
            self._check(trainer, metrics)

    @hookimpl
    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        n = self.every_n_steps
        # Every batch of an accumulation ends with the same step: check once.
        if n is not None and step % n == 0 and step > 0 and step != self._checked_step:
            self._check(trainer, {})

    @hookimpl
    def on_save_checkpoint(self, state: dict[str, Any]) -> None:
        state.update(best=[list(entry) for entry in self.best], last=self.last)

    @hookimpl
    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        self.best = [list(entry) for entry in state["best"]]
        self.last = state["last"]

    # the check -------------------------------------------------------------------------------------
    def _rank_key(self, entry: list[Any]) -> tuple[float, int]:
        score = float(entry[1])
        if math.isnan(score):
            return (math.inf, -entry[2])
        # Ties: the newer wins.
        return (score if self.mode == "min" else -score, -entry[2])

    def _check(self, trainer: Any, metrics: dict[str, float]) -> None:
        step = self._checked_step = trainer.global_step
        if self.monitor is None:
            score, label = float(step), "kept"
        else:
            value = monitored_value("ModelCheckpoint", self.monitor, metrics, trainer)
            score = float(trainer.engine.broadcast(value, 0))  # rank 0's value decides for everyone
            label = f"{_UNSAFE.sub('_', self.monitor)}-{score:.6g}"
        fmt = self.format or trainer.checkpoint_format
        name = f"step-{step:06d}-{label}" + (".ckpt" if fmt == "full" else "")
        directory = self.dirpath if self.dirpath is not None else trainer.checkpoint_dir
        self._directory = directory
        candidates = [e for e in self.best if e[0] != name] + [[name, score, step]]
        candidates.sort(key=(lambda e: -e[2]) if self.monitor is None else self._rank_key)
        before = (list(self.best), self.last)
        self.best, self.last = candidates[: self.save_top_k], name
        try:
            trainer.save_checkpoint(_store.join(directory, name), format=fmt)
        except BaseException:
            self.best, self.last = before
            raise
        if trainer.is_global_zero:
            from stratagem.trainer._run_dir import publish_last, remove_checkpoint

            publish_last(directory, name)
            keep = {e[0] for e in self.best} | {name}
            for old in {e[0] for e in before[0]} | ({before[1]} if before[1] else set()):
                if old not in keep:
                    remove_checkpoint(_store.join(directory, old))
