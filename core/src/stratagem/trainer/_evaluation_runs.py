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
from stratagem.engine.seed import capture_rng, restore_rng
from stratagem.errors import CheckpointError, ConfigurationError
from stratagem.strategies.precision import half_kernel_errors
from stratagem.trainer import _fit_checks, _predictions
from stratagem.trainer._model_calls import batch_for
from stratagem.trainer._run_dir import find_last_checkpoint

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.trainer.module import Module

#: ``ckpt_path`` values besides a path.
_NAMED = ("last", "best")


class EvaluationRuns:
    """The Trainer's evaluation entry points; the Trainer holds the model they set up."""

    engine: Engine
    module: Module | None
    model: torch.nn.Module | None
    callbacks: list[Any]
    options: Any

    def validate(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> dict[str, float]:
        """Run ``validation_step`` over ``dataloaders``; return the metrics, reduced across ranks.

        ``ckpt_path``: ``None`` (the model as it is), ``"last"`` (the newest complete checkpoint under
        ``default_root_dir``), ``"best"`` (the best of a ``ModelCheckpoint`` callback), or a checkpoint's path.
        """
        loader = self._start_evaluation("validate", "validation_step", model, dataloaders, ckpt_path)
        with self._precision_errors():
            return self._run_validation(self._prepare_loader(loader))

    def test(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> dict[str, float]:
        """Run ``test_step`` over ``dataloaders``; return the metrics it logged, reduced across ranks as
        validation's are. ``ckpt_path`` as for :meth:`validate`."""
        loader = self._start_evaluation("test", "test_step", model, dataloaders, ckpt_path)
        with self._precision_errors():
            return self._run_evaluation(self._prepare_loader(loader), "test")

    def predict(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[Any] | None:
        """Run ``predict_step`` over ``dataloaders``. On rank 0, return the predictions of the whole dataset in
        dataset order, on CPU, batched as the loader batches it in one process (each process predicted its share;
        the samples a distributed sampler repeats to even out the shares are dropped); ``None`` on other ranks.
        ``ckpt_path`` as for :meth:`validate`."""
        loader = self._start_evaluation("predict", "predict_step", model, dataloaders, ckpt_path)
        sampler = self.engine.distributed_sampler_kwargs()
        replicas, rank = int(sampler.get("num_replicas", 1)), int(sampler.get("rank", 0))
        if not self.options.use_distributed_sampler:
            replicas, rank = 1, 0
        batch_size = getattr(loader, "batch_size", None)
        loader, indices = _predictions.prediction_loader(loader, replicas, rank)
        with self._precision_errors():
            outputs = self._predict_batches(loader)
        if replicas == 1:
            # One share (alone, or with tensor-parallel peers that predicted the same): rank 0 holds every
            # prediction, in order already.
            return outputs if self.engine.is_global_zero else None
        mine = [(None if indices is None else indices[i], output) for i, output in enumerate(outputs)]
        per_rank = self._gather_predictions(mine, rank)
        return _predictions.in_dataset_order(per_rank, batch_size) if per_rank is not None else None

    # ----------------------------------------------------------------------------------------------
    def _start_evaluation(
        self, method: str, step: str, model: Module | None, dataloaders: Any, ckpt_path: Any
    ) -> Any:
        """Checks (before anything launches), the launch, the model set up, its weights from ``ckpt_path``."""
        model = self._plain_module(model) if model is not None else self.module
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
        self._check_evaluation_ckpt(method, ckpt_path)
        if self.engine.needs_launch:
            self._launch()
        # Hugging Face weights (init_weights) only where no checkpoint is named to evaluate.
        self._setup(model, with_optimizers=False, init_weights=None if ckpt_path else self._init_weights)
        path = self._evaluation_ckpt(method, ckpt_path)
        if path is not None:
            assert self.model is not None
            self.engine.load(path, {"model": self.model}, strict=True)
            self.print(f"{method}: weights from {path}")
        return dataloaders

    def _check_evaluation_ckpt(self, method: str, ckpt_path: Any) -> None:
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
        return [c for c in self.callbacks if callable(getattr(c, "best_checkpoint", None))]

    def _evaluation_ckpt(self, method: str, ckpt_path: Any) -> Path | str | None:
        if ckpt_path is None:
            return None
        if ckpt_path == "best":
            best = self._best_holders()[0].best_checkpoint(self)
            if best is None:
                raise CheckpointError(
                    "(best)",
                    f'{method}(ckpt_path="best"): the ModelCheckpoint has kept no checkpoint yet (it saves '
                    "after validations, or every_n_steps, during fit). Fit first, or pass a path.",
                )
            return _store.location(best)
        if ckpt_path == "last":
            directory = self.checkpoint_dir
            found = find_last_checkpoint(directory) if self.engine.is_global_zero else None
            found = self.engine.broadcast(None if found is None else str(found), 0)
            if found is None:
                raise CheckpointError(
                    directory,
                    f'holds no complete checkpoint for {method}(ckpt_path="last"). Pass a path, or fit first.',
                )
            return _store.location(found)
        return self._resolve_ckpt_path(ckpt_path)

    def _predict_batches(self, loader: Any) -> list[Any]:
        assert self.model is not None
        was_training = self.model.training
        rng = capture_rng()
        self.model.eval()
        outputs = []
        try:
            with torch.no_grad():
                for batch_idx, batch in enumerate(loader):
                    batch = batch_for(batch, self.engine.device, self.engine.precision)
                    # predict_step, or the strategy's own forward-only run (a pipeline's, over its stages).
                    output = self._evaluate_batch(batch, batch_idx, "predict")
                    outputs.append(_predictions.to_cpu(output))
        finally:
            self.model.train(was_training)
            restore_rng(rng)
        return outputs

    def _gather_predictions(self, mine: _predictions.Batches, dp_rank: int) -> list[Any] | None:
        """Every data-parallel rank's predictions on rank 0 (``None`` elsewhere). The first process of each
        data-parallel rank sends them; its tensor-parallel peers hold the same."""
        engine = self.engine
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
    def _precision_errors(self) -> Iterator[None]:
        """``16-true``: an op without a float16 kernel becomes an error naming it and what to do."""
        engine = self.engine
        with half_kernel_errors(engine.precision, engine.device.type, engine.strategy_name):
            yield

    if TYPE_CHECKING:  # the Trainer's and its other mixins'
        checkpoint_dir: Any
        _init_weights: Any

        def _launch(self) -> None: ...
        def _plain_module(self, model: Any) -> Any: ...
        def _setup(self, model: Module, *, with_optimizers: bool, init_weights: Any = None) -> None: ...
        def _prepare_loader(self, loader: Any) -> Any: ...
        def _resolve_ckpt_path(self, ckpt_path: Any) -> Path | str | None: ...
        def _run_validation(self, loader: Any, epoch: int | None = None) -> dict[str, float]: ...
        def _run_evaluation(self, loader: Any, stage: str, epoch: int | None = None) -> dict[str, float]: ...
        def _call(self, method: str, *args: Any) -> Any: ...
        def _evaluate_batch(self, batch: Any, batch_idx: int, stage: str) -> Any: ...
        def print(self, *args: Any) -> None: ...
