"""What a :class:`~stratagem.Trainer` saves and how it resumes: the state it hands the Engine (model,
optimizers, schedulers, scaler, position in the data, RNG, callbacks' states), the periodic checkpoints with
their ``last`` pointer and pruning, and loading a checkpoint to continue exactly where it was written (at
another world size too)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.checkpoint import PerRank, _store
from stratagem.engine.seed import capture_rng
from stratagem.errors import CheckpointError, ConfigurationError
from stratagem.trainer._batch_rule import Consumption, continue_with
from stratagem.trainer._resume import Position, epoch_sampler
from stratagem.trainer._run_dir import (
    CHECKPOINT_DIR,
    LAST_POINTER,
    checkpoint_name,
    find_last_checkpoint,
    pointer_directory,
    prune,
    publish_last,
)

if TYPE_CHECKING:
    import torch

    from stratagem.engine import Engine
    from stratagem.registry._event_hooks import TrainerEventHooks
    from stratagem.trainer._configured_optimizers import Scheduler
    from stratagem.trainer._options import TrainerOptions
    from stratagem.trainer._preemption_stop import Preemption
    from stratagem.trainer._recovery import Recovery
    from stratagem.trainer.module import Module


class CheckpointingMixin:
    """The Trainer's checkpoint methods; the Trainer holds the state they read and restore."""

    options: TrainerOptions
    engine: Engine
    position: Position
    module: Module | None
    model: torch.nn.Module | None
    optimizers: list[Any]
    lr_schedulers: list[Scheduler]
    _events: TrainerEventHooks
    _recovery: Recovery
    _preemption: Preemption
    _epoch_rng: dict[str, Any] | None
    _resume: dict[str, Any] | None
    _last_saved_step: int | None
    _init_weights: Any
    #: The train loader's per-process batch size (None: no fixed one), set by ``fit``.
    _batch_size: int | None = None

    def print(self, *args: Any) -> None:  # the Trainer's
        raise NotImplementedError

    @property
    def checkpoint_dir(self) -> Path | str:
        return _store.join(self.options.default_root_dir, CHECKPOINT_DIR)

    @property
    def checkpoint_format(self) -> str:
        return self.options.checkpoint_format or getattr(self.engine.strategy, "checkpoint_format", "full")

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        format: str | None = None,
        *,
        blocking: bool = True,
        _on_published: Any = None,
    ) -> None:
        """Save the model, optimizers, schedulers, position in the data and RNG states. Call it on every rank.
        ``blocking=False``: see :meth:`Engine.save`."""
        if self.model is None:
            raise ConfigurationError("save_checkpoint() before fit(): there is no model set up to save yet.")
        extras: dict[str, Any] = {}
        assert self.module is not None
        self.module.on_save_checkpoint(extras)
        state = self._live_state()
        state.update(
            progress=self.position.to_dict(),
            rng=PerRank(capture_rng()),
            epoch_rng=PerRank(self._epoch_rng),
            extras=extras,
            topology=self._consumption().to_dict(),
        )
        if self.module.__dict__.get("_stratagem_hparams_saved"):
            # Module.save_hyperparameters(): what load_from_checkpoint builds the module from.
            state["hyperparameters"] = dict(self.module.hparams)
        if "_stratagem_hf" in self.module.__dict__:
            # Where init_weights came from and how names map: what `stratagem checkpoint export` reads.
            state["hf"] = dict(self.module.__dict__["_stratagem_hf"])
        if "on_save_checkpoint" in self._events.implemented:
            state["callbacks"] = PerRank(self._events.collect_states(self, str(path)))
        preempted = self._preemption.record(self.position.step)
        if preempted is not None:  # the checkpoint a preemption stopped at says so
            state["preempted"] = preempted
        self.engine.save(
            path,
            state,
            format=format or self.checkpoint_format,
            blocking=blocking,
            _on_published=_on_published,
        )
        self._last_saved_step = self.position.step
        self._recovery.saved()

    def _live_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model}
        for i, optimizer in enumerate(self.optimizers):
            state["optimizer" if i == 0 else f"optimizer_{i}"] = optimizer
        for i, scheduler in enumerate(self.lr_schedulers):
            state[f"lr_scheduler_{i}"] = scheduler.scheduler
        scaler = getattr(self.engine.strategy, "scaler", None)
        if scaler is not None:
            state["grad_scaler"] = scaler
        return state

    def _consumption(self) -> Consumption:
        """What this run consumes per optimizer step (recorded in its checkpoints). Its "processes" are the
        data-parallel replicas, among which the sampler deals the data: the world size, except where ranks share
        their batches (tensor-parallel or pipeline ranks), so that a pipeline resumed at another degree goes
        on with the same samples."""
        replicas = self.engine.data_parallel_size
        return Consumption(self._batch_size, replicas, self.options.accumulate_grad_batches)

    @staticmethod
    def _checked_init_weights(init_weights: Any) -> Any:
        """``Trainer(init_weights=...)`` as ``HFWeights``; a local path that does not exist fails here, before
        anything launches."""
        from stratagem.checkpoint._hf_match import checked_request

        return None if init_weights is None else checked_request(init_weights)

    def _start_from(self, ckpt_path: Any) -> tuple[Path | str | None, Any]:
        """``(checkpoint to resume from, Hugging Face weights to load)``: never both, the checkpoint winning."""
        self.engine.setup_environment()
        resume_from = self._resolve_ckpt_path(self._recovery.ckpt_path(ckpt_path))
        if resume_from is None or self._init_weights is None:
            return resume_from, self._init_weights
        from stratagem.checkpoint._hf_load import FROM_CHECKPOINT

        self.print(f"init_weights is not read: resuming from {resume_from}, whose weights take precedence.")
        return resume_from, FROM_CHECKPOINT

    def _resolve_ckpt_path(self, ckpt_path: Any) -> Path | str | None:
        if ckpt_path is None:
            return None
        if ckpt_path == "last":
            return self._newest_under(self.checkpoint_dir)
        target = _store.location(ckpt_path)
        # A run's `last` pointer given as the path: a small text file naming a checkpoint beside it.
        directory = None
        if _store.name_of(target) == LAST_POINTER:
            found = pointer_directory(target) if self.engine.is_global_zero else None
            directory = self.engine.broadcast(None if found is None else str(found), 0)
        if directory is None:
            return target
        found = find_last_checkpoint(_store.location(directory)) if self.engine.is_global_zero else None
        newest = self.engine.broadcast(None if found is None else str(found), 0)
        if newest is None:
            raise CheckpointError(
                target,
                f"is the `last` pointer of {directory}, which holds no complete checkpoint (the one it names is "
                "missing or partial). Pass an existing checkpoint, or None to start fresh.",
            )
        self.print(
            f"ckpt_path={str(ckpt_path)!r} is the `last` pointer of {directory}, not a checkpoint: resuming from "
            f'the checkpoint it names, as ckpt_path="last" would in that run ({newest}).'
        )
        return _store.location(newest)

    def _newest_under(self, directory: Path | str) -> Path | str | None:
        found = find_last_checkpoint(directory) if self.engine.is_global_zero else None
        found = self.engine.broadcast(None if found is None else str(found), 0)
        if found is None:
            self.print(f"No checkpoint under {directory}: training from the start.")
            return None
        return _store.location(found)

    def _load_for_resume(self, path: Path | str, train_loader: Any) -> None:
        rest = self.engine.load(path, self._live_state(), strict=True)
        progress = rest.get("progress")
        if not isinstance(progress, dict):
            raise CheckpointError(
                path,
                "holds no training position (it was not written by Trainer.save_checkpoint); load it "
                "with Engine.load, or start fit() without ckpt_path.",
            )
        self.position = Position.from_dict(progress)
        self._resume = {"rng": rest.get("rng"), "epoch_rng": rest.get("epoch_rng")}
        accumulate, message = continue_with(
            self.position,
            rest.get("topology"),
            self._consumption(),
            keep_global_batch=self.options.keep_global_batch,
            starts_at_sample=epoch_sampler(train_loader) is not None,
        )
        if accumulate != self.options.accumulate_grad_batches:
            self.options = attrs.evolve(self.options, accumulate_grad_batches=accumulate)
        if message is not None:
            self.print(message)
        assert self.module is not None
        if isinstance(rest.get("hf"), dict):  # the Hugging Face folder the run started from, for its exports
            self.module.__dict__["_stratagem_hf"] = dict(rest["hf"])
        self.module.on_load_checkpoint(dict(rest.get("extras") or {}))
        if isinstance(rest.get("callbacks"), dict):
            self._events.restore_states(self, str(path), rest["callbacks"])
        self._last_saved_step = self.position.step
        self._preemption.resumed = rest.get("preempted") if isinstance(rest.get("preempted"), dict) else None
        self.print(f"Resumed from {path} at step {self.position.step} (epoch {self.position.epoch}).")

    def _save_periodic(self) -> None:
        name = checkpoint_name(self.position.step, self.checkpoint_format)
        if self.options.async_checkpoint:
            directory, keep = self.checkpoint_dir, self.options.keep_last_k

            def published() -> None:  # rank 0, in the background, once the checkpoint is published
                publish_last(directory, name)
                if keep is not None:
                    prune(directory, keep=keep, protect=name)

            self.save_checkpoint(
                _store.join(directory, name),
                blocking=False,
                _on_published=published if self.engine.is_global_zero else None,
            )
            return
        self.save_checkpoint(_store.join(self.checkpoint_dir, name))
        if self.engine.is_global_zero:
            publish_last(self.checkpoint_dir, name)
            if self.options.keep_last_k is not None:
                prune(self.checkpoint_dir, keep=self.options.keep_last_k, protect=name)
