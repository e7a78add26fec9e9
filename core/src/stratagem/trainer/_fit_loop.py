"""The Trainer's fit loop: epochs, batches, accumulation and the optimizer step, stopping when every rank
agrees, and the periodic checkpoints and validations it triggers."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import torch

from stratagem.trainer import _callbacks_and_loggers
from stratagem.trainer._model_calls import batch_for, call_step, loss_of
from stratagem.trainer._resume import Epoch, loader_length, start_epoch
from stratagem.trainer.module import step_functions

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.trainer._callbacks_and_loggers import TrainerEvents
    from stratagem.trainer._checkpointing import CheckpointManager
    from stratagem.trainer._evaluation import Evaluator
    from stratagem.trainer._metrics import RunMetrics
    from stratagem.trainer._preemption_stop import Preemption
    from stratagem.trainer._progress import Console, ProgressBar
    from stratagem.trainer._recovery import Recovery
    from stratagem.trainer._run_state import RunState


class FitLoop:
    """The loop of one Trainer's ``fit`` over ``run``: the parts it drives are given to it, and it sends the
    Trainer's events through ``events``."""

    def __init__(
        self,
        engine: Engine,
        run: RunState,
        *,
        events: TrainerEvents,
        metrics: RunMetrics,
        evaluator: Evaluator,
        checkpoints: CheckpointManager,
        recovery: Recovery,
        preemption: Preemption,
        console: Console,
    ) -> None:
        self._engine, self._run, self._events, self._metrics = engine, run, events, metrics
        self._evaluator, self._checkpoints = evaluator, checkpoints
        self._recovery, self._preemption, self._console = recovery, preemption, console
        #: Whether the last batch completed an optimizer step (``trainer.is_logging_step`` asks).
        self.stepped = False
        self._epoch: Epoch | None = None  # the epoch under way
        self._bar: ProgressBar | None = None

    def run(self, loader: Any, val_loader: Any) -> None:
        """Train until ``max_steps`` or ``max_epochs`` or until the ranks agree to stop; then the last
        checkpoint, written (or raised) before this returns."""
        engine, run, opts = self._engine, self._run, self._run.options
        max_epochs = opts.max_epochs if (opts.max_epochs or opts.max_steps) else 1
        accumulate = opts.accumulate_grad_batches
        length = loader_length(loader)
        steps_per_epoch = None if length is None else math.ceil(length / accumulate)
        total = opts.max_steps
        if max_epochs is not None and steps_per_epoch is not None:
            by_epochs = max_epochs * steps_per_epoch
            total = by_epochs if total is None else min(total, by_epochs)
        enabled = engine.is_global_zero and opts.enable_progress_bar
        self._bar = bar = self._console.start_bar(enabled=enabled, total=total, step=run.position.step)
        assert run.model is not None
        run.model.train()
        recovery, preemption, events = self._recovery, self._preemption, self._events
        recovery.start()
        preemption.arm()
        run.should_stop = False
        try:
            events.call("on_fit_start")
            if engine.is_global_zero:
                params = _callbacks_and_loggers.hyperparameters(opts, engine, run.module)
                events.call("log_hyperparams", params=params)
            self._metrics.writing = True
            self._epochs(loader, val_loader, max_epochs)
            if self._metrics.train:
                self._metrics.write_train()
            periodic = (
                opts.checkpoint_every_n_steps is not None or opts.checkpoint_every_n_minutes is not None
            )
            # A signal the ranks have not acted on yet stops the run here, saved like any other.
            preempted = preemption.settle()
            if (periodic or preempted) and self._checkpoints.last_saved_step != run.position.step:
                self._checkpoints.save_periodic()
            engine.wait_for_checkpoint()  # fit returns with every checkpoint written (or raises)
            # Raises Preempted (a SystemExit) once the ranks agreed.
            step = run.position.step
            preemption.exit_if_stopped(
                step, self._checkpoints.path_of, self.on_exception, self._console.print
            )
            events.call("on_fit_end")
        except Exception as error:
            self.on_exception(error)
            raise
        finally:
            preemption.disarm()
            recovery.stop()
            bar.close()
        summary = recovery.summary()
        if summary is not None:
            self._console.print(summary)
        engine.barrier("fit-end")

    def on_exception(self, error: BaseException) -> None:
        try:
            self._events.call("on_exception", exception=error)
        except Exception as also:  # the original error is the one to report
            print(
                f"stratagem: on_exception of a callback raised {type(also).__name__}: {also}", file=sys.stderr
            )

    def _stop_agreed(self) -> bool:
        """Whether any rank asked to stop (every rank calls this at the same points: it is a collective)."""
        engine, run = self._engine, self._run
        if engine.world_size > 1:
            flag = torch.tensor([float(run.should_stop)], dtype=torch.float64, device=engine.device)
            run.should_stop = bool(engine.all_reduce(flag, "max").item())
        return run.should_stop

    def _done(self, max_epochs: int | None) -> bool:
        max_steps, position = self._run.options.max_steps, self._run.position
        if max_steps is not None and position.step >= max_steps:
            return True
        return max_epochs is not None and position.epoch >= max_epochs

    def _epochs(self, loader: Any, val_loader: Any, max_epochs: int | None) -> None:
        position = self._run.position
        while not self._done(max_epochs):
            epoch = self._start_epoch(loader)
            self._events.call("on_train_epoch_start", epoch=position.epoch)
            for batch in epoch.batches:
                # A resumed epoch may end sooner than a whole one: its batches began at the checkpoint's sample.
                last_of_epoch = epoch.end is not None and position.batch_in_epoch + 1 == epoch.end
                if self._train_batch(batch, last_of_epoch, val_loader):
                    return
            self._end_epoch(val_loader)
            if self._stop_agreed():
                return

    def _start_epoch(self, loader: Any) -> Epoch:
        run = self._run
        resume, run.resume = run.resume, None
        self._epoch, run.epoch_rng = start_epoch(loader, run.position, resume)
        return self._epoch

    def _end_epoch(self, val_loader: Any) -> None:
        run = self._run
        position = run.position
        ended = position.epoch
        for scheduler in run.lr_schedulers:
            if scheduler.interval == "epoch" and (ended + 1) % scheduler.frequency == 0:
                scheduler.scheduler.step()
        # The position moves on before the epoch's validation, so that a checkpoint written there (a best-k
        # one) resumes at the next epoch rather than replaying this epoch's end.
        position.epoch += 1
        position.batch_in_epoch = 0
        if position.samples_in_epoch is not None:
            position.samples_in_epoch = 0
        run.epoch_rng, self._epoch = None, None
        if val_loader is not None and run.options.val_check_interval is None:
            self._evaluator.validate(val_loader, epoch=ended)
        self._events.call("on_train_epoch_end", epoch=ended)

    def _train_batch(self, batch: Any, last_of_epoch: bool, val_loader: Any) -> bool:
        """One batch; an optimizer step at the end of each accumulation. True when training is done."""
        run, engine = self._run, self._engine
        opts, position = run.options, run.position
        batch_idx = position.batch_in_epoch
        boundary = last_of_epoch or (batch_idx + 1) % opts.accumulate_grad_batches == 0
        beat = self._recovery.beat
        beat(position.step, batch_idx, "training_step")
        batch = batch_for(batch, engine.device, engine.precision)
        events = self._events
        events.call("on_train_batch_start", batch=batch, batch_idx=batch_idx)
        with engine.no_sync(run.model, enabled=not boundary):
            output, loss = self._forward_backward(batch, batch_idx)
        self._metrics.train.add("loss", loss.detach())
        assert self._epoch is not None
        self._epoch.advance(position, batch_idx + 1)
        self.stepped = boundary
        if not boundary:
            events.call(
                "on_train_batch_end", outputs=output, batch=batch, batch_idx=batch_idx, step=position.step
            )
            beat(position.step, batch_idx + 1, "data")
            return False
        beat(position.step, batch_idx, "optimizer_step")
        self._optimizer_step()
        position.step += 1
        self._recovery.step_done(position.step)
        events.call(
            "on_train_batch_end", outputs=output, batch=batch, batch_idx=batch_idx, step=position.step
        )
        logging = position.step % opts.log_every_n_steps == 0
        if logging:
            beat(position.step, batch_idx, "logging")
            self._metrics.write_train()
        assert self._bar is not None
        self._bar.update(position.step)
        validating = bool(
            val_loader is not None
            and opts.val_check_interval
            and position.step % opts.val_check_interval == 0
        )
        if validating:
            self._evaluator.validate(val_loader)
        by_steps = opts.checkpoint_every_n_steps and position.step % opts.checkpoint_every_n_steps == 0
        preempted = self._preemption.agreed()  # a collective: every rank stops at this step, or none does
        if preempted or self._recovery.save_due() or by_steps:
            beat(position.step, batch_idx, "checkpoint")
            self._checkpoints.save_periodic()
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
        run, engine = self._run, self._engine
        accumulate, model = run.options.accumulate_grad_batches, run.model
        split_batch, compute_loss = step_functions(run.module)
        with self._metrics.strategy_step():
            owned = engine.run_training_batch(
                model, batch, batch_idx, split_batch, compute_loss, 1.0 / accumulate
            )
        if owned is not None:
            assert owned.loss is not None
            return owned.loss, owned.loss
        with engine.forward_context():
            output = call_step(model, run.module, "training_step", batch, batch_idx)
        loss = loss_of(output)
        self._recovery.beat(run.position.step, batch_idx, "backward")
        engine.backward(loss / accumulate if accumulate > 1 else loss, model)
        return output, loss

    def _optimizer_step(self) -> None:
        run = self._run
        clip = run.options.gradient_clip_val
        for optimizer in run.optimizers:
            self._events.call("on_before_optimizer_step", optimizer=optimizer, step=run.position.step)
            if clip is not None:
                self._engine.clip_gradients(run.model, optimizer, clip)
            optimizer.step()
        for optimizer in run.optimizers:
            optimizer.zero_grad()
        step = run.position.step + 1
        for scheduler in run.lr_schedulers:
            if scheduler.interval == "step" and step % scheduler.frequency == 0:
                scheduler.scheduler.step()
