"""The Trainer's fit loop: epochs, batches, accumulation and the optimizer step, stopping when every rank
agrees, and the periodic checkpoints and validations it triggers."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import torch

from stratagem.trainer import _callbacks_and_loggers
from stratagem.trainer._model_calls import batch_for, loss_of
from stratagem.trainer._progress import ProgressBar
from stratagem.trainer._resume import Epoch, Position, loader_length, start_epoch
from stratagem.trainer.module import step_functions

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.registry._event_hooks import TrainerEventHooks
    from stratagem.trainer._configured_optimizers import Scheduler
    from stratagem.trainer._metrics import MetricStore
    from stratagem.trainer._options import TrainerOptions
    from stratagem.trainer._preemption_stop import Preemption
    from stratagem.trainer._recovery import Recovery


class TrainingLoop:
    """The Trainer's loop methods; the Trainer holds the state they advance."""

    options: TrainerOptions
    engine: Engine
    position: Position
    model: torch.nn.Module | None
    module: Any
    optimizers: list[Any]
    lr_schedulers: list[Scheduler]
    should_stop: bool
    _events: TrainerEventHooks
    _recovery: Recovery
    _preemption: Preemption
    _train_metrics: MetricStore
    _bar: ProgressBar | None
    _epoch_rng: dict[str, Any] | None
    _epoch: Epoch | None = None  # the epoch under way
    _resume: dict[str, Any] | None
    _last_saved_step: int | None
    _logging: bool
    _stepped: bool
    _owned_step: bool

    def _fit_loop(self, loader: Any, val_loader: Any) -> None:
        opts = self.options
        max_epochs = opts.max_epochs if (opts.max_epochs or opts.max_steps) else 1
        accumulate = opts.accumulate_grad_batches
        length = loader_length(loader)
        steps_per_epoch = None if length is None else math.ceil(length / accumulate)
        total = opts.max_steps
        if max_epochs is not None and steps_per_epoch is not None:
            by_epochs = max_epochs * steps_per_epoch
            total = by_epochs if total is None else min(total, by_epochs)
        self._bar = ProgressBar(enabled=self.engine.is_global_zero and opts.enable_progress_bar)
        self._bar.start(total=total, step=self.position.step)
        assert self.model is not None
        self.model.train()
        recovery = self._recovery
        recovery.start()
        self._preemption.arm()
        events = self._events
        self.should_stop = False
        try:
            events.call("on_fit_start", trainer=self)
            if self.engine.is_global_zero:
                events.call(
                    "log_hyperparams", trainer=self, params=_callbacks_and_loggers.hyperparameters(self)
                )
            self._logging = True
            self._epochs(loader, val_loader, max_epochs)
            if self._train_metrics:
                self._log_train_metrics()
            periodic = (
                opts.checkpoint_every_n_steps is not None or opts.checkpoint_every_n_minutes is not None
            )
            # A signal the last boundary's exchange carried stops the run here, saved like any other.
            preempted = self._preemption.settle()
            if (periodic or preempted) and self._last_saved_step != self.position.step:
                self._save_periodic()
            self.engine.wait_for_checkpoint()  # fit returns with every checkpoint written (or raises)
            self._preemption.exit_if_stopped(self)  # raises Preempted (a SystemExit) once the ranks agreed
            events.call("on_fit_end", trainer=self)
        except Exception as error:
            self._on_exception(error)
            raise
        finally:
            self._preemption.disarm()
            recovery.stop()
            self._bar.close()
        summary = recovery.summary()
        if summary is not None:
            self.print(summary)
        self.engine.barrier("fit-end")

    def _on_exception(self, error: Exception) -> None:
        try:
            self._events.call("on_exception", trainer=self, exception=error)
        except Exception as also:  # the original error is the one to report
            print(
                f"stratagem: on_exception of a callback raised {type(also).__name__}: {also}", file=sys.stderr
            )

    def _stop_agreed(self) -> bool:
        """Whether any rank asked to stop (every rank calls this at the same points: it is a collective)."""
        if self.engine.world_size > 1:
            flag = torch.tensor([float(self.should_stop)], dtype=torch.float64, device=self.engine.device)
            self.should_stop = bool(self.engine.all_reduce(flag, "max").item())
        return self.should_stop

    def _done(self, max_epochs: int | None) -> bool:
        max_steps = self.options.max_steps
        if max_steps is not None and self.position.step >= max_steps:
            return True
        return max_epochs is not None and self.position.epoch >= max_epochs

    def _epochs(self, loader: Any, val_loader: Any, max_epochs: int | None) -> None:
        position = self.position
        while not self._done(max_epochs):
            epoch = self._start_epoch(loader)
            self._events.call("on_train_epoch_start", trainer=self, epoch=position.epoch)
            for batch in epoch.batches:
                # A resumed epoch may end sooner than a whole one: its batches began at the checkpoint's sample.
                last_of_epoch = epoch.end is not None and position.batch_in_epoch + 1 == epoch.end
                if self._train_batch(batch, last_of_epoch, val_loader):
                    return
            self._end_epoch(val_loader)
            if self._stop_agreed():
                return

    def _start_epoch(self, loader: Any) -> Epoch:
        resume, self._resume = self._resume, None
        self._epoch, self._epoch_rng = start_epoch(loader, self.position, resume)
        return self._epoch

    def _end_epoch(self, val_loader: Any) -> None:
        ended = self.position.epoch
        for scheduler in self.lr_schedulers:
            if scheduler.interval == "epoch" and (ended + 1) % scheduler.frequency == 0:
                scheduler.scheduler.step()
        # The position moves on before the epoch's validation, so that a checkpoint written there (a best-k
        # one) resumes at the next epoch rather than replaying this epoch's end.
        self.position.epoch += 1
        self.position.batch_in_epoch = 0
        if self.position.samples_in_epoch is not None:
            self.position.samples_in_epoch = 0
        self._epoch_rng, self._epoch = None, None
        if val_loader is not None and self.options.val_check_interval is None:
            self._run_validation(val_loader, epoch=ended)
        self._events.call("on_train_epoch_end", trainer=self, epoch=ended)

    def _train_batch(self, batch: Any, last_of_epoch: bool, val_loader: Any) -> bool:
        """One batch; an optimizer step at the end of each accumulation. True when training is done."""
        opts, position, engine = self.options, self.position, self.engine
        batch_idx = position.batch_in_epoch
        boundary = last_of_epoch or (batch_idx + 1) % opts.accumulate_grad_batches == 0
        beat = self._recovery.beat
        beat(position.step, batch_idx, "training_step")
        batch = batch_for(batch, engine.device, engine.precision)
        events = self._events
        events.call("on_train_batch_start", trainer=self, batch=batch, batch_idx=batch_idx)
        with engine.no_sync(self.model, enabled=not boundary):
            output, loss = self._forward_backward(batch, batch_idx)
        self._train_metrics.add("loss", loss.detach())
        assert self._epoch is not None
        self._epoch.advance(position, batch_idx + 1)
        self._stepped = boundary
        if not boundary:
            events.call(
                "on_train_batch_end",
                trainer=self,
                outputs=output,
                batch=batch,
                batch_idx=batch_idx,
                step=position.step,
            )
            beat(position.step, batch_idx + 1, "data")
            return False
        beat(position.step, batch_idx, "optimizer_step")
        self._optimizer_step()
        position.step += 1
        self._recovery.step_done(position.step)
        events.call(
            "on_train_batch_end",
            trainer=self,
            outputs=output,
            batch=batch,
            batch_idx=batch_idx,
            step=position.step,
        )
        logging = position.step % opts.log_every_n_steps == 0
        if logging:
            beat(position.step, batch_idx, "logging")
            self._log_train_metrics()
        assert self._bar is not None
        self._bar.update(position.step)
        validating = bool(
            val_loader is not None
            and opts.val_check_interval
            and position.step % opts.val_check_interval == 0
        )
        if validating:
            self._run_validation(val_loader)
        by_steps = opts.checkpoint_every_n_steps and position.step % opts.checkpoint_every_n_steps == 0
        preempted = self._preemption.agreed()  # a collective: every rank stops at this step, or none does
        if preempted or self._recovery.save_due() or by_steps:
            beat(position.step, batch_idx, "checkpoint")
            self._save_periodic()
        beat(position.step, batch_idx + 1, "data")
        if preempted:
            return True
        if (logging or validating) and self._stop_agreed():
            return True
        return opts.max_steps is not None and position.step >= opts.max_steps

    def _forward_backward(self, batch: Any, batch_idx: int) -> tuple[Any, torch.Tensor]:
        """Forward and backward of one batch: the strategy's own step when it runs one (a pipeline), else
        ``training_step`` in ``forward_context``, then ``backward``. Returns what ``on_train_batch_end`` gets
        (the step's return value; the loss under a strategy's own step) and the loss to log."""
        engine, accumulate = self.engine, self.options.accumulate_grad_batches
        split_batch, compute_loss = step_functions(self.module)
        self._owned_step = True  # self.log would run on some ranks only (a pipeline's last stage)
        try:
            owned = engine.run_training_batch(
                self.model, batch, batch_idx, split_batch, compute_loss, 1.0 / accumulate
            )
        finally:
            self._owned_step = False
        if owned is not None:
            assert owned.loss is not None
            return owned.loss, owned.loss
        with engine.forward_context():
            output = self._call("training_step", batch, batch_idx)
        loss = loss_of(output)
        self._recovery.beat(self.position.step, batch_idx, "backward")
        engine.backward(loss / accumulate if accumulate > 1 else loss, self.model)
        return output, loss

    def _optimizer_step(self) -> None:
        clip = self.options.gradient_clip_val
        for optimizer in self.optimizers:
            self._events.call(
                "on_before_optimizer_step", trainer=self, optimizer=optimizer, step=self.position.step
            )
            if clip is not None:
                self.engine.clip_gradients(self.model, optimizer, clip)
            optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        step = self.position.step + 1
        for scheduler in self.lr_schedulers:
            if scheduler.interval == "step" and step % scheduler.frequency == 0:
                scheduler.scheduler.step()
