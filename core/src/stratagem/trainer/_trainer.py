"""``stratagem.Trainer``: the fit loop (accumulation, clipping, validation, logging, periodic checkpoints and
exact resume), test and predict, on top of one :class:`~stratagem.engine.Engine`, with its events sent to the
callbacks and loggers it was given (see the Trainer events in :mod:`stratagem.hookspecs`).

The Trainer makes its parts and gives each what it needs (docs/architecture.md lists them); they share the run's
state (``_run_state``) and get the Trainer only to hand it to callbacks."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from stratagem.engine import DEFAULT_TIMEOUT_S, Engine
from stratagem.launchers import _restarts
from stratagem.launchers._watchdog import collective_timeout
from stratagem.registry._event_hooks import TrainerEventHooks
from stratagem.trainer import _callbacks_and_loggers, _fit_checks
from stratagem.trainer._batch_rule import loader_batch_size
from stratagem.trainer._checkpointing import CheckpointManager, check_format
from stratagem.trainer._evaluation import Evaluator
from stratagem.trainer._evaluation_runs import EvaluationRuns, precision_errors
from stratagem.trainer._fit_loop import FitLoop
from stratagem.trainer._metrics import RunMetrics
from stratagem.trainer._options import TrainerOptions
from stratagem.trainer._preemption_stop import Preemption, PreemptionOptions
from stratagem.trainer._progress import Console
from stratagem.trainer._recovery import Recovery
from stratagem.trainer._run_setup import RunSetup, checked_init_weights
from stratagem.trainer._run_state import RunState, Shared
from stratagem.trainer.module import Module

__all__ = ["Trainer", "TrainerOptions"]


class Trainer:
    """Fit a :class:`~stratagem.Module` under a strategy chosen by name.

    :param strategy: a registered name, ``"auto"`` or a ``Strategy`` instance (see :class:`~stratagem.Engine`).
        ``"auto"`` with several processes plans the model at ``fit`` and takes the strategy that fits each
        device's memory with the least communication (docs/planning.md).
    :param accelerator: ``"auto"``, ``"cpu"`` or ``"cuda"``.
    :param devices: processes per node. With more than one and no launcher around, ``fit`` re-runs the script
        in that many workers (torch's elastic agent); this process waits and exits with their status.
    :param num_nodes: nodes (start one ``stratagem run`` or ``torchrun`` per node).
    :param precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"`` (CUDA only) or
        ``"16-true"`` (parameters and computation in float16; an op without a float16 kernel on the device is
        an error naming it). Under ``*-true`` the batches' floating-point tensors reach the steps in that dtype.
    :param max_steps: stop after this many optimizer steps.
    :param max_epochs: stop after this many epochs (with neither limit: one epoch).
    :param accumulate_grad_batches: batches per optimizer step; gradients are not synchronised on the others.
    :param gradient_clip_val: clip the total gradient norm to this value.
    :param val_check_interval: validate every this many optimizer steps (default: at the end of each epoch).
    :param limit_val_batches: validate on at most this many batches.
    :param checkpoint_every_n_steps: write ``default_root_dir/checkpoints/step-NNNNNN[.ckpt]`` this often, and
        at the end of ``fit``; ``checkpoints/last`` names the newest complete one.
    :param keep_last_k: keep only the newest k of those checkpoints.
    :param checkpoint_format: ``"full"`` or ``"sharded"``; default: the strategy's.
    :param default_root_dir: where ``metrics.csv`` and ``checkpoints/`` go.
    :param seed: seed python, numpy and torch at the start of ``fit``, and draw a shuffled epoch's order.
    :param log_every_n_steps: reduce the logged metrics across ranks and write them out this often.
    :param enable_progress_bar: show the progress bar on rank 0.
    :param use_distributed_sampler: give loaders an ``EpochSampler`` unless they have a sampler of their own.
    :param timeout: seconds a rank may go without progress: the hang watchdog then names the rank that did not
        arrive and ends the run (or the attempt, with restarts); collectives time out somewhat later.
    :param max_restarts: restart the workers this many times after a failure (a crash, a kill, a hang), resuming
        from the newest complete checkpoint of the run (see docs/fault-tolerance.md).
    :param checkpoint_every_n_minutes: also checkpoint on this wall-clock cadence (rank 0's clock decides).
    :param restart_from_scratch: allow ``max_restarts`` without any checkpoint cadence (a restart then begins at
        step 0); refused otherwise.
    :param async_checkpoint: periodic checkpoints return once the state is copied off the training path and are
        written in the background (one at a time; a failure is raised at the next save or at the end of ``fit``,
        which waits for the last one). See docs/checkpoints.md.
    :param keep_global_batch: when resuming a checkpoint at another world size or per-process batch, change
        ``accumulate_grad_batches`` so that an optimizer step takes as many samples as in the run that wrote it,
        where a whole number of batches does; ``False`` keeps the script's setting. See docs/fault-tolerance.md.
    :param preemption_signals: signals that preempt the run (``()``: none): every rank stops at the same step,
        saves it, and the run exits with code 75 (:class:`~stratagem.Preempted`). See docs/fault-tolerance.md.
    :param preemption_grace_s: the seconds the scheduler leaves between its signal and the kill.
    :param slurm_requeue: a preempted SLURM job requeues itself (default: when it may and SLURM is not ending it).
    :param launcher: how the workers start (see :class:`~stratagem.Engine`): ``"auto"``, a name, or an instance.
    :param launcher_options: options for the named launcher (``{"partition": "gpu"}`` for ``"slurm"``).
    :param callbacks: objects whose methods implement Trainer events with ``@stratagem.hookimpl``
        (:mod:`stratagem.callbacks` has ``EarlyStopping``, ``ModelCheckpoint``, ``LearningRateMonitor``,
        ``Throughput``), or names registered by installed plugins. They run in the order given, on every rank.
    :param loggers: names (``"csv"``, ``"tensorboard"``, ``"mlflow"``, ``"wandb"``) or instances (see
        :mod:`stratagem.loggers`); default ``["csv"]`` (``metrics.csv`` under ``default_root_dir``); ``[]`` for
        none. They write from global rank 0 only.
    :param compile: ``True`` or a dict of ``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``regional``:
        ``torch.compile`` the model in the framework's place (after tensor parallelism and activation
        checkpointing, before data-parallel wrapping; each repeated block once by default). Checked here, before
        anything launches. See :meth:`stratagem.Engine.setup`. A ``torch.compile``'d model is unwrapped and compiled
        so, with the options torch.compile was given unless ``compile=`` is set (``False``: not compiled).
    :param init_weights: Hugging Face weights to start from: a model folder, a ``.safetensors`` file or its index,
        local or at a URL, or a :class:`~stratagem.checkpoint.hf.HFWeights` (adapter, strict). ``configure_model``
        then builds on the meta device and each rank reads only its parts; a mismatch is refused before training;
        a checkpoint ``fit`` resumes from takes precedence (docs/hugging-face.md).
    """

    def __init__(
        self,
        *,
        strategy: Any = "auto",
        accelerator: str = "auto",
        devices: int = 1,
        num_nodes: int = 1,
        precision: str | int = "32-true",
        max_steps: int | None = None,
        max_epochs: int | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        val_check_interval: int | None = None,
        limit_val_batches: int | None = None,
        checkpoint_every_n_steps: int | None = None,
        keep_last_k: int | None = None,
        checkpoint_format: str | None = None,
        default_root_dir: str | os.PathLike[str] = "runs",
        seed: int | None = None,
        log_every_n_steps: int = 10,
        enable_progress_bar: bool = True,
        use_distributed_sampler: bool = True,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_restarts: int = 0,
        checkpoint_every_n_minutes: float | None = None,
        restart_from_scratch: bool = False,
        launcher: Any = "auto",
        launcher_options: Any = None,
        callbacks: Any = None,
        loggers: Any = None,
        async_checkpoint: bool = False,
        keep_global_batch: bool = True,
        preemption_signals: Any = ("SIGTERM", "SIGUSR1"),
        preemption_grace_s: float = 30.0,
        slurm_requeue: bool | None = None,
        compile: Any = None,
        init_weights: Any = None,
    ) -> None:
        options = TrainerOptions(
            max_steps=max_steps,
            max_epochs=max_epochs,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            val_check_interval=val_check_interval,
            limit_val_batches=limit_val_batches,
            checkpoint_every_n_steps=checkpoint_every_n_steps,
            keep_last_k=keep_last_k,
            checkpoint_format=checkpoint_format,
            default_root_dir=default_root_dir,
            seed=seed,
            log_every_n_steps=log_every_n_steps,
            enable_progress_bar=enable_progress_bar,
            use_distributed_sampler=use_distributed_sampler,
            max_restarts=max_restarts,
            checkpoint_every_n_minutes=checkpoint_every_n_minutes,
            restart_from_scratch=restart_from_scratch,
            async_checkpoint=async_checkpoint,
            keep_global_batch=keep_global_batch,
        )
        preemption = PreemptionOptions(
            signals=preemption_signals, grace_s=preemption_grace_s, slurm_requeue=slurm_requeue
        )
        self.engine = Engine(
            strategy=strategy,
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            # Longer than the hang watchdog's `timeout`, so that the watchdog names the rank that hangs.
            timeout=collective_timeout(timeout),
            max_restarts=max_restarts,
            launcher=launcher,
            launcher_options=launcher_options,
        )
        # Checked before anything launches; the workers get the checked options (False: none, whatever the
        # environment says).
        compile_options = self.engine.resolve_compile(compile) or False
        init_weights = checked_init_weights(init_weights)
        launcher_restarts = _restarts.max_restarts()
        if launcher_restarts and not max_restarts:
            # Restarts asked of the launcher (`stratagem run --max-restarts`, `torchrun --max-restarts`).
            options.check_restarts_can_resume(f"--max-restarts {launcher_restarts} of the launcher")
        recovery = self._recovery = Recovery(
            self.engine,
            timeout=timeout,
            every_n_minutes=checkpoint_every_n_minutes,
            max_restarts=max_restarts,
        )
        self._preemption = Preemption(self.engine, preemption)
        check_format(checkpoint_format, self.engine)
        # Names are resolved here, before anything launches: an unknown name or a missing extra fails now.
        self.callbacks = _callbacks_and_loggers.resolve(callbacks, "callback")
        self.loggers = _callbacks_and_loggers.resolve(loggers, "logger")
        self._events = TrainerEventHooks(_callbacks_and_loggers.named(self.callbacks + self.loggers))
        # The parts, each given what it needs. They share the run's state; `events` holds this Trainer only to
        # hand it to the callbacks and loggers.
        engine, preemption = self.engine, self._preemption
        run = self._run = RunState(options)
        events = _callbacks_and_loggers.TrainerEvents(self._events, self)
        console = self._console = Console(engine)
        metrics = self._metrics = RunMetrics(engine, run, events, recovery, console)
        evaluator = Evaluator(engine, run, metrics, events, recovery, console)
        checkpoints = self._checkpoints = CheckpointManager(
            engine, run, events, recovery, preemption, console
        )
        setup = self._setup = RunSetup(
            engine,
            run,
            compile=compile_options,
            compile_off=compile is False,
            init_weights=init_weights,
            preemption=preemption,
            console=console,
            attach_to=self,
        )
        self._loop = FitLoop(
            engine,
            run,
            events=events,
            metrics=metrics,
            evaluator=evaluator,
            checkpoints=checkpoints,
            recovery=recovery,
            preemption=preemption,
            console=console,
        )
        self._evaluation = EvaluationRuns(
            engine,
            run,
            setup=setup,
            evaluator=evaluator,
            checkpoints=checkpoints,
            callbacks=self.callbacks,
            trainer=self,
            console=console,
        )

    # what callbacks and users read (and set) -------------------------------------------------------
    options = Shared("_run", "The Trainer's options (a resume may change ``accumulate_grad_batches``).")
    position = Shared("_run", "Where training is: step, epoch, batches and samples of the epoch consumed.")
    module = Shared(
        "_run", "The :class:`~stratagem.Module` being trained (``None`` before ``fit``/``validate``)."
    )
    model = Shared("_run", "The model as the strategy wrapped it (``None`` before ``fit``/``validate``).")
    optimizers = Shared("_run", "The optimizers, stepped through the strategy.")
    lr_schedulers = Shared("_run", "The learning-rate schedulers with when the loop steps them.")
    should_stop = Shared(
        "_run",
        "Set it (on any rank) to end ``fit``: the ranks agree after each validation, at each logging step and at "
        "the end of each epoch, and stop at the same step.",
    )
    ckpt_path = Shared("_run", "The checkpoint the current ``fit`` resumed from, if any.")
    logged_metrics = Shared("_metrics", "The latest reduced metrics (training and validation).", as_="logged")

    @property
    def strategy(self) -> Any:
        return self.engine.strategy

    @property
    def global_step(self) -> int:
        return self._run.position.step

    @property
    def current_epoch(self) -> int:
        return self._run.position.epoch

    @property
    def is_global_zero(self) -> bool:
        return self.engine.is_global_zero

    @property
    def default_root_dir(self) -> Path | str:
        return self._run.options.default_root_dir

    @property
    def is_logging_step(self) -> bool:
        """In ``on_train_batch_end``: whether this batch completed an optimizer step whose metrics are reduced
        and written now (every ``log_every_n_steps``); values ``trainer.log`` records then are among them."""
        return self._loop.stepped and self._run.position.step % self._run.options.log_every_n_steps == 0

    @property
    def checkpoint_dir(self) -> Path | str:
        return self._checkpoints.checkpoint_dir

    @property
    def checkpoint_format(self) -> str:
        return self._checkpoints.checkpoint_format

    # public API ------------------------------------------------------------------------------------
    def init_module(self, empty_init: bool = False) -> contextlib.AbstractContextManager[None]:
        """Build the model in here: on the device, in the parameter dtype, on the meta device with
        ``empty_init`` where the strategy materialises it later.

        In a process that will only launch the workers, the model is built on the meta device: it is never
        trained here, and the workers build their own.
        """
        if self.engine.needs_launch:
            return torch.device("meta")
        return self.engine.init_module(empty_init=empty_init)

    def fit(
        self,
        model: Module,
        train_dataloaders: Any,
        val_dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Train ``model``. ``ckpt_path``: ``None`` (start fresh), ``"last"`` (resume from the newest complete
        checkpoint under ``default_root_dir``, or start fresh if there is none), or a checkpoint's path (given a
        run's ``checkpoints/last`` pointer, the checkpoint it names)."""
        engine, run, setup = self.engine, self._run, self._setup
        model = setup.plain_module(model)
        # In a process that only launches and was given a strategy's name, the strategy is checked if made
        # already: creating it here imports its plugin, which only delays the workers (they check again).
        made = not engine.needs_launch or engine._runtime.created is not None
        _fit_checks.check_fit(
            engine, model, train_dataloaders, val_dataloaders, ckpt_path, strategy_made=made
        )
        if engine.needs_launch:
            setup.launch()
        # A checkpoint to resume from wins over Hugging Face weights (init_weights), which are then not read.
        resume_from, init_weights = self._checkpoints.start_from(ckpt_path, setup.init_weights)
        setup.setup(model, with_optimizers=True, init_weights=init_weights)
        run.batch_size = loader_batch_size(train_dataloaders)
        if run.batch_size is not None:
            engine.check_batch_size(run.batch_size)
        train_loader = setup.prepare_loader(train_dataloaders)
        val_loader = None if val_dataloaders is None else setup.prepare_loader(val_dataloaders)
        if resume_from is not None:
            self._checkpoints.load_for_resume(resume_from, train_loader)
        report = self._recovery.resumed(run.position.step, self._preemption.resumed)
        if report is not None:
            self.print(report)
        run.ckpt_path = resume_from
        with precision_errors(engine):
            self._loop.run(train_loader, val_loader)

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
        return self._evaluation.validate(model, dataloaders, ckpt_path)

    def test(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> dict[str, float]:
        """Run ``test_step`` over ``dataloaders``; return the metrics it logged, reduced across ranks as
        validation's are. ``ckpt_path`` as for :meth:`validate`."""
        return self._evaluation.test(model, dataloaders, ckpt_path)

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
        return self._evaluation.predict(model, dataloaders, ckpt_path)

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
        self._checkpoints.save(path, format, blocking=blocking, on_published=_on_published)

    def log(self, name: str, value: Any, *, prog_bar: bool = False, reduce: str = "mean") -> None:
        """Record a metric from a callback, like ``Module.log``: reduced across ranks (log it on every rank)
        and written at the next logging step."""
        self._metrics.log(name, value, prog_bar=prog_bar, reduce=reduce)

    def print(self, *args: Any) -> None:
        """Print on rank 0 (above the progress bar while it runs); nothing in a process that only launches."""
        self._console.print(*args)
