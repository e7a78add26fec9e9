"""``stratagem.Trainer``: the fit loop (accumulation, clipping, validation, logging, periodic checkpoints and
exact resume), test and predict, on top of one :class:`~stratagem.engine.Engine`, with its events sent to the
callbacks and loggers it was given (see the Trainer events in :mod:`stratagem.hookspecs`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from stratagem.engine import DEFAULT_TIMEOUT_S, Engine
from stratagem.errors import ConfigurationError
from stratagem.launchers import _restarts
from stratagem.launchers._watchdog import collective_timeout
from stratagem.registry._event_hooks import TrainerEventHooks
from stratagem.trainer import _callbacks_and_loggers, _fit_checks, _planned_module
from stratagem.trainer._batch_rule import loader_batch_size
from stratagem.trainer._checkpointing import CheckpointingMixin
from stratagem.trainer._compiled import CompiledModels
from stratagem.trainer._configured_optimizers import Scheduler
from stratagem.trainer._evaluation import Evaluation
from stratagem.trainer._evaluation_runs import EvaluationRuns
from stratagem.trainer._loop import TrainingLoop
from stratagem.trainer._metrics import MetricStore
from stratagem.trainer._model_calls import redirected_forward
from stratagem.trainer._options import TrainerOptions
from stratagem.trainer._preemption_stop import Preemption, PreemptionOptions
from stratagem.trainer._progress import ProgressBar
from stratagem.trainer._recovery import Recovery
from stratagem.trainer._resume import Position
from stratagem.trainer._teardown import _register_teardown
from stratagem.trainer.module import Module

__all__ = ["Trainer", "TrainerOptions"]


class Trainer(TrainingLoop, Evaluation, EvaluationRuns, CheckpointingMixin, CompiledModels):
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
        self.options = TrainerOptions(
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
        self._compile, self._compile_off = self.engine.resolve_compile(compile) or False, compile is False
        self._init_weights = self._checked_init_weights(init_weights)
        launcher_restarts = _restarts.max_restarts()
        if launcher_restarts and not max_restarts:
            # Restarts asked of the launcher (`stratagem run --max-restarts`, `torchrun --max-restarts`).
            self.options.check_restarts_can_resume(f"--max-restarts {launcher_restarts} of the launcher")
        self._recovery = Recovery(
            self.engine,
            timeout=timeout,
            every_n_minutes=checkpoint_every_n_minutes,
            max_restarts=max_restarts,
        )
        self._preemption = Preemption(self.engine, preemption)
        if checkpoint_format is not None:
            caps = self.engine.capabilities
            if caps is not None and checkpoint_format not in caps.checkpoint_formats:
                raise ConfigurationError(
                    f"Trainer(checkpoint_format={checkpoint_format!r}): strategy {self.engine.strategy.name!r} "
                    f"writes {sorted(caps.checkpoint_formats)}."
                )
        self.position = Position()
        #: The latest reduced metrics (training and validation).
        self.logged_metrics: dict[str, float] = {}
        self.module: Module | None = None
        self.model: torch.nn.Module | None = None
        self.optimizers: list[Any] = []
        self.lr_schedulers: list[Scheduler] = []
        self._train_metrics = MetricStore()
        self._val_metrics = MetricStore()
        self._in_validation = False
        self._epoch_rng: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None
        self._bar: ProgressBar | None = None
        self._last_saved_step: int | None = None
        # Names are resolved here, before anything launches: an unknown name or a missing extra fails now.
        self.callbacks = _callbacks_and_loggers.resolve(callbacks, "callback")
        self.loggers = _callbacks_and_loggers.resolve(loggers, "logger")
        self._events = TrainerEventHooks(_callbacks_and_loggers.named(self.callbacks + self.loggers))
        #: Set it (on any rank) to end ``fit``: the ranks agree after each validation, at each logging step
        #: and at the end of each epoch, and stop at the same step.
        self.should_stop = False
        #: The checkpoint the current ``fit`` resumed from, if any.
        self.ckpt_path: Path | None = None
        self._logging = False
        self._stepped = False
        self._owned_step = False

    # properties ------------------------------------------------------------------------------------
    @property
    def strategy(self) -> Any:
        return self.engine.strategy

    @property
    def global_step(self) -> int:
        return self.position.step

    @property
    def current_epoch(self) -> int:
        return self.position.epoch

    @property
    def is_global_zero(self) -> bool:
        return self.engine.is_global_zero

    @property
    def default_root_dir(self) -> Path | str:
        return self.options.default_root_dir

    @property
    def is_logging_step(self) -> bool:
        """In ``on_train_batch_end``: whether this batch completed an optimizer step whose metrics are reduced
        and written now (every ``log_every_n_steps``); values ``trainer.log`` records then are among them."""
        return self._stepped and self.position.step % self.options.log_every_n_steps == 0

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

        # Asked only when configure_optimizers gives nothing: it creates the strategy in a launching process.
        def strategy_optimizer() -> bool:
            return _fit_checks.provides_optimizer(self.engine.strategy)

        model = self._plain_module(model)
        _fit_checks.check_model(model, for_fit=True, strategy_optimizer=strategy_optimizer)
        _fit_checks.check_loader(train_dataloaders, "train_dataloaders")
        if self.engine.plans_auto:  # strategy="auto" on several processes: what fits (docs/planning.md)
            self.engine.choose_strategy(_planned_module.fit_workload(model, train_dataloaders))
        _fit_checks.check_step(model, self._strategy_if_made())
        if val_dataloaders is not None:
            _fit_checks.check_loader(val_dataloaders, "val_dataloaders")
        _fit_checks.check_ckpt_path(ckpt_path)
        if self.engine.needs_launch:
            _fit_checks.check_optimizers_before_launch(model, strategy_optimizer)
            self._launch()
        resume_from, init_weights = self._start_from(ckpt_path)
        self._setup(model, with_optimizers=True, init_weights=init_weights)
        self._batch_size = loader_batch_size(train_dataloaders)
        if self._batch_size is not None:
            self.engine.check_batch_size(self._batch_size)
        train_loader = self._prepare_loader(train_dataloaders)
        val_loader = None if val_dataloaders is None else self._prepare_loader(val_dataloaders)
        if resume_from is not None:
            self._load_for_resume(resume_from, train_loader)
        report = self._recovery.resumed(self.position.step, self._preemption.resumed)
        if report is not None:
            self.print(report)
        self.ckpt_path = resume_from
        with self._precision_errors():
            self._fit_loop(train_loader, val_loader)

    def log(self, name: str, value: Any, *, prog_bar: bool = False, reduce: str = "mean") -> None:
        """Record a metric from a callback, like ``Module.log``: reduced across ranks (log it on every rank)
        and written at the next logging step."""
        self._log_metric(name, value, prog_bar=prog_bar, reduce=reduce)

    def print(self, *args: Any) -> None:
        """Print on rank 0 (above the progress bar while it runs); nothing in a process that only launches."""
        if self.engine.needs_launch or not self.engine.is_global_zero:
            return
        message = " ".join(str(a) for a in args)
        if self._bar is not None and self._bar.enabled:
            self._bar.print(message)
        else:
            print(message, flush=True)

    def _strategy_if_made(self) -> Any:
        """The strategy, except in a process that only launches and was given its name: creating it there
        imports its plugin, which only delays the workers (they check again)."""
        if self.engine.needs_launch and self.engine._strategy is None:
            return None
        return self.engine.strategy

    def _launch(self) -> None:
        _fit_checks.check_relaunchable(self.engine.devices)
        self.engine.supervise(**self._preemption.job_fields())

    # set-up ----------------------------------------------------------------------------------------
    def _setup(self, model: Module, *, with_optimizers: bool, init_weights: Any = None) -> None:
        engine = self.engine
        if self.module is not None and model is not self.module:
            raise ConfigurationError("This Trainer already trains another model; make one Trainer per model.")
        first = self.model is None
        if first:
            engine.setup_environment()
            _register_teardown(engine)
            if self.options.seed is not None:
                engine.seed_everything(self.options.seed)
            model.__dict__["_stratagem_trainer"] = self
            self.module = model
            if not model.__dict__.get("_stratagem_configured", False):
                with engine.init_module(empty_init=init_weights is not None):
                    model.configure_model()
                model.__dict__["_stratagem_configured"] = True
        elif self.options.seed is not None and with_optimizers:
            engine.seed_everything(self.options.seed)
        wrap = {"compile": self._compile, "init_weights": init_weights}
        if with_optimizers and not self.optimizers:
            optimizers, self.lr_schedulers = _fit_checks.configured_optimizers(model, engine.strategy)
            if first and optimizers:
                self.model, *self.optimizers = engine.setup(model, *optimizers, **wrap)
            else:
                if first:  # no optimizer of the module's: the strategy's configuration defines it
                    self.model = engine.setup_module(model, **wrap)
                # Set up by validate() before: optimizers over the wrapped model's parameters.
                self.optimizers = engine.setup_optimizers(self.model, *optimizers)
        elif first:
            self.model = engine.setup_module(model, **wrap)

    def _prepare_loader(self, loader: Any) -> Any:
        return self.engine.setup_dataloaders(
            loader,
            use_distributed_sampler=self.options.use_distributed_sampler,
            seed=self.options.seed or 0,
        )

    def _call(self, method: str, *args: Any) -> Any:
        # Always through the wrapped model's __call__, also when the strategy wrapped in place (FSDP2, tensor
        # parallel): their forward hooks gather the root's parameters, which calling the step directly skips.
        model, module = self.model, self.module
        assert model is not None and module is not None
        with redirected_forward(module, method):
            return model(*args)
