"""``HFExport``: the model as a Hugging Face folder at the end of ``fit`` (and every n steps), written from the
sharded state by every rank at once (:func:`stratagem.checkpoint.hf.save_weights`), without a checkpoint
first."""

from __future__ import annotations

import os
from typing import Any

from stratagem.errors import ConfigurationError
from stratagem.hookspecs import hookimpl


class HFExport:
    """Write ``<dirpath>/final`` when ``fit`` ends, and ``<dirpath>/step-NNNNNN`` every ``every_n_steps``
    optimizer steps: ``model-0000X-of-0000N.safetensors``, ``model.safetensors.index.json``, and the config
    and tokenizer files of the folder the run started from (``init_weights``), else the ``transformers``
    model's config. Each is loadable with ``from_pretrained``; a directory that exists is replaced.

    :param dirpath: where the exports go (default: ``<default_root_dir>/hf``); a local path every rank sees,
        or an object-store URL (one node).
    :param every_n_steps: also export at these steps (``None``: at the end only).
    :param max_shard_size: the most data per file (default ``"5GB"``, the Hugging Face convention).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        every_n_steps: int | None = None,
        max_shard_size: int | str = "5GB",
    ) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ConfigurationError(
                f"HFExport(every_n_steps={every_n_steps!r}): give a positive number or None."
            )
        from stratagem.checkpoint._safetensors import parse_size

        try:
            parse_size(max_shard_size)
        except ValueError as error:
            raise ConfigurationError(f"HFExport: {error}") from None
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.max_shard_size = max_shard_size
        self._last_step: int | None = None
        #: The exports written, in order (every rank knows them).
        self.written: list[str] = []

    def _export(self, trainer: Any, name: str) -> None:
        from stratagem.checkpoint import _store
        from stratagem.checkpoint.hf import save_weights

        root = self.dirpath if self.dirpath is not None else _store.join(trainer.default_root_dir, "hf")
        target = _store.join(_store.location(root), name)
        save_weights(
            trainer.engine, trainer.model, target, max_shard_size=self.max_shard_size, overwrite=True
        )
        self.written.append(str(target))

    @hookimpl
    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if self.every_n_steps and step and step % self.every_n_steps == 0 and step != self._last_step:
            self._last_step = step
            self._export(trainer, f"step-{step:06d}")

    @hookimpl
    def on_fit_end(self, trainer: Any) -> None:
        self._export(trainer, "final")
