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
    from stratagem.engine import Engine
    from stratagem.trainer._callbacks_and_loggers import TrainerEvents
    from stratagem.trainer._preemption_stop import Preemption
    from stratagem.trainer._progress import Console
    from stratagem.trainer._recovery import Recovery
    from stratagem.trainer._run_state import RunState


def check_format(checkpoint_format: str | None, engine: Engine) -> None:
    """``Trainer(checkpoint_format=...)`` against what the strategy declares it writes."""
    if checkpoint_format is None:
        return
    caps = engine.capabilities
    if caps is not None and checkpoint_format not in caps.checkpoint_formats:
        raise ConfigurationError(
            f"Trainer(checkpoint_format={checkpoint_format!r}): strategy {engine.strategy.name!r} "
            f"writes {sorted(caps.checkpoint_formats)}."
        )


class CheckpointManager:
    """One Trainer's checkpoints of ``run``: written through the Engine, under ``default_root_dir`` for the
    periodic ones, and read back to resume."""

    def __init__(
        self,
        engine: Engine,
        run: RunState,
        events: TrainerEvents,
        recovery: Recovery,
        preemption: Preemption,
        console: Console,
    ) -> None:
        self._engine, self._run, self._events = engine, run, events
        self._recovery, self._preemption, self._console = recovery, preemption, console
        #: The step of the newest checkpoint this run wrote or resumed from.
        self.last_saved_step: int | None = None

    @property
    def checkpoint_dir(self) -> Path | str:
        return _store.join(self._run.options.default_root_dir, CHECKPOINT_DIR)

    @property
    def checkpoint_format(self) -> str:
        return self._run.options.checkpoint_format or getattr(
            self._engine.strategy, "checkpoint_format", "full"
        )

    def path_of(self, step: int) -> Path | str:
        """Where the periodic checkpoint of ``step`` goes."""
        return _store.join(self.checkpoint_dir, checkpoint_name(step, self.checkpoint_format))

    def save(
        self,
        path: str | os.PathLike[str],
        format: str | None = None,
        *,
        blocking: bool = True,
        on_published: Any = None,
    ) -> None:
        """``Trainer.save_checkpoint`` (documented there)."""
        run = self._run
        if run.model is None:
            raise ConfigurationError("save_checkpoint() before fit(): there is no model set up to save yet.")
        extras: dict[str, Any] = {}
        assert run.module is not None
        run.module.on_save_checkpoint(extras)
        state = self._live_state()
        state.update(
            progress=run.position.to_dict(),
            rng=PerRank(capture_rng()),
            epoch_rng=PerRank(run.epoch_rng),
            extras=extras,
            topology=self._consumption().to_dict(),
        )
        if run.module.__dict__.get("_stratagem_hparams_saved"):
            # Module.save_hyperparameters(): what load_from_checkpoint builds the module from.
            state["hyperparameters"] = dict(run.module.hparams)
        if "_stratagem_hf" in run.module.__dict__:
            # Where init_weights came from and how names map: what `stratagem checkpoint export` reads.
            state["hf"] = dict(run.module.__dict__["_stratagem_hf"])
        if "on_save_checkpoint" in self._events.implemented:
            state["callbacks"] = PerRank(self._events.collect_states(str(path)))
        preempted = self._preemption.record(run.position.step)
        if preempted is not None:  # the checkpoint a preemption stopped at says so
            state["preempted"] = preempted
        self._engine.save(
            path,
            state,
            format=format or self.checkpoint_format,
            blocking=blocking,
            _on_published=on_published,
        )
        self.last_saved_step = run.position.step
        self._recovery.saved()

    def _live_state(self) -> dict[str, Any]:
        run = self._run
        state: dict[str, Any] = {"model": run.model}
        for i, optimizer in enumerate(run.optimizers):
            state["optimizer" if i == 0 else f"optimizer_{i}"] = optimizer
        for i, scheduler in enumerate(run.lr_schedulers):
            state[f"lr_scheduler_{i}"] = scheduler.scheduler
        scaler = getattr(self._engine.strategy, "scaler", None)
        if scaler is not None:
            state["grad_scaler"] = scaler
        return state

    def _consumption(self) -> Consumption:
        """What this run consumes per optimizer step (recorded in its checkpoints). Its "processes" are the
        data-parallel replicas, among which the sampler deals the data: the world size, except where ranks share
        their batches (tensor-parallel or pipeline ranks), so that a pipeline resumed at another degree goes
        on with the same samples."""
        replicas = self._engine.data_parallel_size
        return Consumption(self._run.batch_size, replicas, self._run.options.accumulate_grad_batches)

    def start_from(self, ckpt_path: Any, init_weights: Any) -> tuple[Path | str | None, Any]:
        """``(checkpoint to resume from, Hugging Face weights to load)`` for ``fit(ckpt_path=...)`` (or the
        newest checkpoint, after a restart) and ``Trainer(init_weights=...)``: never both, the checkpoint
        winning."""
        self._engine.setup_environment()
        resume_from = self.resolve(self._recovery.ckpt_path(ckpt_path))
        if resume_from is None or init_weights is None:
            return resume_from, init_weights
        from stratagem.checkpoint._hf_load import FROM_CHECKPOINT

        self._console.print(
            f"init_weights is not read: resuming from {resume_from}, whose weights take precedence."
        )
        return resume_from, FROM_CHECKPOINT

    def resolve(self, ckpt_path: Any) -> Path | str | None:
        """The checkpoint ``ckpt_path`` means (``"last"``: the newest complete one under ``default_root_dir``;
        a run's ``last`` pointer: the checkpoint it names), the same on every rank."""
        if ckpt_path is None:
            return None
        if ckpt_path == "last":
            return self._newest_under(self.checkpoint_dir)
        target = _store.location(ckpt_path)
        # A run's `last` pointer given as the path: a small text file naming a checkpoint beside it.
        directory = None
        if _store.name_of(target) == LAST_POINTER:
            found = pointer_directory(target) if self._engine.is_global_zero else None
            directory = self._engine.broadcast(None if found is None else str(found), 0)
        if directory is None:
            return target
        found = find_last_checkpoint(_store.location(directory)) if self._engine.is_global_zero else None
        newest = self._engine.broadcast(None if found is None else str(found), 0)
        if newest is None:
            raise CheckpointError(
                target,
                f"is the `last` pointer of {directory}, which holds no complete checkpoint (the one it names is "
                "missing or partial). Pass an existing checkpoint, or None to start fresh.",
            )
        self._console.print(
            f"ckpt_path={str(ckpt_path)!r} is the `last` pointer of {directory}, not a checkpoint: resuming from "
            f'the checkpoint it names, as ckpt_path="last" would in that run ({newest}).'
        )
        return _store.location(newest)

    def _newest_under(self, directory: Path | str) -> Path | str | None:
        found = find_last_checkpoint(directory) if self._engine.is_global_zero else None
        found = self._engine.broadcast(None if found is None else str(found), 0)
        if found is None:
            self._console.print(f"No checkpoint under {directory}: training from the start.")
            return None
        return _store.location(found)

    def load_for_resume(self, path: Path | str, train_loader: Any) -> None:
        """Restore ``run`` from the checkpoint at ``path``: what it trains, where it was, what its first epoch
        replays, and the callbacks' states."""
        run = self._run
        rest = self._engine.load(path, self._live_state(), strict=True)
        progress = rest.get("progress")
        if not isinstance(progress, dict):
            raise CheckpointError(
                path,
                "holds no training position (it was not written by Trainer.save_checkpoint); load it "
                "with Engine.load, or start fit() without ckpt_path.",
            )
        run.position = Position.from_dict(progress)
        run.resume = {"rng": rest.get("rng"), "epoch_rng": rest.get("epoch_rng")}
        accumulate, message = continue_with(
            run.position,
            rest.get("topology"),
            self._consumption(),
            keep_global_batch=run.options.keep_global_batch,
            starts_at_sample=epoch_sampler(train_loader) is not None,
        )
        if accumulate != run.options.accumulate_grad_batches:
            run.options = attrs.evolve(run.options, accumulate_grad_batches=accumulate)
        if message is not None:
            self._console.print(message)
        assert run.module is not None
        if isinstance(rest.get("hf"), dict):  # the Hugging Face folder the run started from, for its exports
            run.module.__dict__["_stratagem_hf"] = dict(rest["hf"])
        run.module.on_load_checkpoint(dict(rest.get("extras") or {}))
        if isinstance(rest.get("callbacks"), dict):
            self._events.restore_states(str(path), rest["callbacks"])
        self.last_saved_step = run.position.step
        self._preemption.resumed = rest.get("preempted") if isinstance(rest.get("preempted"), dict) else None
        self._console.print(f"Resumed from {path} at step {run.position.step} (epoch {run.position.epoch}).")

    def save_periodic(self) -> None:
        """The checkpoint of the current step under ``default_root_dir``, ``last`` pointed at it once it is
        published, and the older ones beyond ``keep_last_k`` removed."""
        options = self._run.options
        name = checkpoint_name(self._run.position.step, self.checkpoint_format)
        if options.async_checkpoint:
            directory, keep = self.checkpoint_dir, options.keep_last_k

            def published() -> None:  # rank 0, in the background, once the checkpoint is published
                publish_last(directory, name)
                if keep is not None:
                    prune(directory, keep=keep, protect=name)

            self.save(
                _store.join(directory, name),
                blocking=False,
                on_published=published if self._engine.is_global_zero else None,
            )
            return
        self.save(_store.join(self.checkpoint_dir, name))
        if self._engine.is_global_zero:
            publish_last(self.checkpoint_dir, name)
            if options.keep_last_k is not None:
                prune(self.checkpoint_dir, keep=options.keep_last_k, protect=name)
