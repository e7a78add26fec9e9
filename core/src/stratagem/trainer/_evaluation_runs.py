"""``Trainer.validate``, ``test`` and ``predict``: after ``fit`` or on their own, from the model as it is or
from a checkpoint (``ckpt_path``: a path, ``"last"``, or ``"best"`` of a ``ModelCheckpoint``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratagem.checkpoint import _store
from stratagem.errors import CheckpointError, ConfigurationError
from stratagem.strategies.precision import half_kernel_errors
from stratagem.trainer import _fit_checks, _predictions
from stratagem.trainer._run_dir import find_last_checkpoint

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.trainer._checkpointing import CheckpointManager
    from stratagem.trainer._evaluation import Evaluator
    from stratagem.trainer._progress import Console
    from stratagem.trainer._run_setup import RunSetup
    from stratagem.trainer._run_state import RunState
    from stratagem.trainer.module import Module

#: ``ckpt_path`` values besides a path.
_NAMED = ("last", "best")


class EvaluationRuns:
    """``Trainer.validate``, ``test`` and ``predict`` (documented there): set up by ``setup`` as ``fit`` is,
    weights from ``ckpt_path`` through ``checkpoints``, the loop ``evaluator``'s. ``callbacks`` are the
    Trainer's: a ``ModelCheckpoint`` among them is asked for the best checkpoint, given ``trainer`` (the public
    Trainer, which this part only hands on)."""

    def __init__(
        self,
        engine: Engine,
        run: RunState,
        *,
        setup: RunSetup,
        evaluator: Evaluator,
        checkpoints: CheckpointManager,
        callbacks: list[Any],
        trainer: object,
        console: Console,
    ) -> None:
        self._engine, self._run, self._setup, self._evaluator = engine, run, setup, evaluator
        self._checkpoints, self._callbacks, self._console = checkpoints, callbacks, console
        self._trainer = trainer

    def validate(self, model: Module | None, dataloaders: Any, ckpt_path: Any) -> dict[str, float]:
        loader = self._start("validate", "validation_step", model, dataloaders, ckpt_path)
        with precision_errors(self._engine):
            return self._evaluator.validate(self._setup.prepare_loader(loader))

    def test(self, model: Module | None, dataloaders: Any, ckpt_path: Any) -> dict[str, float]:
        loader = self._start("test", "test_step", model, dataloaders, ckpt_path)
        with precision_errors(self._engine):
            return self._evaluator.run(self._setup.prepare_loader(loader), "test")

    def predict(self, model: Module | None, dataloaders: Any, ckpt_path: Any) -> list[Any] | None:
        engine = self._engine
        loader = self._start("predict", "predict_step", model, dataloaders, ckpt_path)
        sampler = engine.distributed_sampler_kwargs()
        replicas, rank = int(sampler.get("num_replicas", 1)), int(sampler.get("rank", 0))
        if not self._run.options.use_distributed_sampler:
            replicas, rank = 1, 0
        batch_size = getattr(loader, "batch_size", None)
        loader, indices = _predictions.prediction_loader(loader, replicas, rank)
        with precision_errors(engine):
            outputs = self._evaluator.predict(loader)
        if replicas == 1:
            # One share (alone, or with tensor-parallel peers that predicted the same): rank 0 holds every
            # prediction, in order already.
            return outputs if engine.is_global_zero else None
        mine = [(None if indices is None else indices[i], output) for i, output in enumerate(outputs)]
        per_rank = self._gather_predictions(mine, rank)
        return _predictions.in_dataset_order(per_rank, batch_size) if per_rank is not None else None

    # ----------------------------------------------------------------------------------------------
    def _start(self, method: str, step: str, model: Module | None, dataloaders: Any, ckpt_path: Any) -> Any:
        """Checks (before anything launches), the launch, the model set up, its weights from ``ckpt_path``."""
        model = self._setup.plain_module(model) if model is not None else self._run.module
        if model is None:
            raise ConfigurationError(f"{method}() needs a model: trainer.{method}(model, dataloaders).")
        if dataloaders is None:
            raise ConfigurationError(
                f"{method}() needs dataloaders: trainer.{method}(model, dataloaders=loader). (A stratagem Module "
                "has no data hooks; the Trainer takes the loaders.)"
            )
        _fit_checks.check_model(model, for_fit=False)
        if step == "test_step" and not type(model).overrides(step):
            raise ConfigurationError(
                f"{type(model).__name__} has no {step}(batch, batch_idx). Define it for trainer.{method}()."
            )
        _fit_checks.check_loader(dataloaders, "dataloaders")
        self._check_ckpt(method, ckpt_path)
        if self._engine.needs_launch:
            self._setup.launch()
        # Hugging Face weights (init_weights) only where no checkpoint is named to evaluate.
        init_weights = None if ckpt_path else self._setup.init_weights
        self._setup.setup(model, with_optimizers=False, init_weights=init_weights)
        path = self._ckpt(method, ckpt_path)
        if path is not None:
            assert self._run.model is not None
            self._engine.load(path, {"model": self._run.model}, strict=True)
            self._console.print(f"{method}: weights from {path}")
        return dataloaders

    def _check_ckpt(self, method: str, ckpt_path: Any) -> None:
        if ckpt_path is None or ckpt_path == "last":
            return
        if ckpt_path == "best":
            if not self._best_holders():
                raise ConfigurationError(
                    f'{method}(ckpt_path="best") needs a ModelCheckpoint callback, whose best checkpoint it '
                    'loads: Trainer(callbacks=[ModelCheckpoint(monitor=...)]). Or pass a path, or "last".'
                )
            return
        if not isinstance(ckpt_path, (str, os.PathLike)):
            raise ConfigurationError(
                f"{method}(ckpt_path={ckpt_path!r}): give None, {', '.join(map(repr, _NAMED))}, or a "
                "checkpoint's path."
            )
        _fit_checks.check_ckpt_path(ckpt_path)

    def _best_holders(self) -> list[Any]:
        return [c for c in self._callbacks if callable(getattr(c, "best_checkpoint", None))]

    def _ckpt(self, method: str, ckpt_path: Any) -> Path | str | None:
        if ckpt_path is None:
            return None
        if ckpt_path == "best":
            best = self._best_holders()[0].best_checkpoint(self._trainer)
            if best is None:
                raise CheckpointError(
                    "(best)",
                    f'{method}(ckpt_path="best"): the ModelCheckpoint has kept no checkpoint yet (it saves '
                    "after validations, or every_n_steps, during fit). Fit first, or pass a path.",
                )
            return _store.location(best)
        if ckpt_path == "last":
            engine, directory = self._engine, self._checkpoints.checkpoint_dir
            found = find_last_checkpoint(directory) if engine.is_global_zero else None
            found = engine.broadcast(None if found is None else str(found), 0)
            if found is None:
                raise CheckpointError(
                    directory,
                    f'holds no complete checkpoint for {method}(ckpt_path="last"). Pass a path, or fit first.',
                )
            return _store.location(found)
        return self._checkpoints.resolve(ckpt_path)

    def _gather_predictions(self, mine: _predictions.Batches, dp_rank: int) -> list[Any] | None:
        """Every data-parallel rank's predictions on rank 0 (``None`` elsewhere). The first process of each
        data-parallel rank sends them; its tensor-parallel peers hold the same."""
        engine = self._engine
        ranks = [int(t) for t in engine.all_gather(torch.tensor([dp_rank], device=engine.device))]
        sender = ranks.index(dp_rank) == engine.rank
        received = []
        for source in range(engine.world_size):
            payload = engine.broadcast(mine if engine.rank == source and sender else None, source)
            if engine.is_global_zero and payload is not None:
                received.append((ranks[source], payload))
        if not engine.is_global_zero:
            return None
        return [payload for _, payload in sorted(received, key=lambda pair: pair[0])]


@contextlib.contextmanager
def precision_errors(engine: Engine) -> Iterator[None]:
    """``16-true``: an op without a float16 kernel becomes an error naming it and what to do."""
    with half_kernel_errors(engine.precision, engine.device.type, engine.strategy_name):
        yield
