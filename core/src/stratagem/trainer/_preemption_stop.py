"""Preemption in the Trainer: a signal that reaches any process of the run (the launcher or a worker) stops every
rank at the same step boundary, with a checkpoint of that step, and ends the run with
:class:`~stratagem.errors.Preempted` (exit code 75), which the next run resumes bit for bit.

- While ``fit`` trains, each worker catches ``Trainer(preemption_signals=...)``: the handler only notes the
  signal and when it came. A launcher that gets one passes it on to its workers
  (:mod:`stratagem.launchers._preemption_signals`); a signal sent to one worker alone reaches the others through the
  agreement below.
- At step boundaries (after the step's validation, where a periodic checkpoint is written) the ranks agree
  through an all-reduce: whether any rank was signalled, the earliest time one was, and which signal. With
  several ranks a boundary starts one without waiting for it, on a gloo group of its own, and the next boundary
  reads it (:mod:`stratagem.trainer._agreement`); when steps are short, one is started only every N boundaries,
  N agreed from the ranks' step times so that a signal waits at most half a second at those step times. Every
  rank decides on the same reduced value, so all stop at the same step, one step after the boundary at which the
  first exchange carrying the signal began; at the end of training one more exchange is waited for. One process
  stops at the boundary that follows its signal. The step they stop at is saved like a periodic checkpoint
  (waiting for an asynchronous save in flight), the pending metrics are written and the loggers close; then
  every rank exits.
- In a SLURM job, rank 0 requeues the job last (``scontrol requeue``): the requeued job restarts the script,
  whose ``fit`` resumes from that checkpoint by itself (``SLURM_RESTART_COUNT`` makes it a restart).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.errors import PREEMPTED_EXIT_CODE, ConfigurationError, Preempted
from stratagem.launchers import _preemption_signals, cluster
from stratagem.trainer import _agreement

if TYPE_CHECKING:
    from pathlib import Path

    from stratagem.engine import Engine

#: How long ``scontrol`` may take to answer before the requeue is given up (the grace period is short).
_SCONTROL_TIMEOUT_S = 10.0


def _requeue_mode(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigurationError(
            f"Trainer(slurm_requeue={value!r}): give True, False, or None (requeue when the job may be requeued "
            "and SLURM is not ending it already)."
        )
    return value


@attrs.frozen(kw_only=True)
class PreemptionOptions:
    """``Trainer(preemption_signals=..., preemption_grace_s=..., slurm_requeue=...)``, checked when the Trainer
    is made."""

    signals: tuple[str, ...] = attrs.field(
        default=_preemption_signals.DEFAULT_SIGNALS, converter=_preemption_signals.signal_names
    )
    grace_s: float = attrs.field(
        default=_preemption_signals.DEFAULT_GRACE_S, converter=_preemption_signals.check_grace
    )
    slurm_requeue: bool | None = attrs.field(default=None, converter=_requeue_mode)


class Preemption:
    """One Trainer's preemption: catching the signals while ``fit`` trains, the ranks' agreement at each step
    boundary, and the end of the run once they agreed."""

    def __init__(self, engine: Engine, options: PreemptionOptions) -> None:
        self.engine = engine
        self.options = options
        #: The first signal this process caught (its number) and when (wall clock).
        self._caught: tuple[int, float] | None = None
        self._previous: dict[int, Any] = {}
        #: Once the ranks agreed: which signal, when the first rank got it, and the step they stopped at.
        self.stopping: dict[str, Any] | None = None
        #: The preemption record of the checkpoint ``fit`` resumed from, if it was a preemption's.
        self.resumed: dict[str, Any] | None = None
        self._agreement: _agreement.Agreement | None = None  # with several ranks, while fit trains

    def job_fields(self) -> dict[str, Any]:
        """What the launcher needs to know (see :class:`~stratagem.launchers.LaunchJob`)."""
        return {"preemption_signals": self.options.signals, "preemption_grace_s": self.options.grace_s}

    # catching ---------------------------------------------------------------------------------------------
    def arm(self) -> None:
        self._caught, self.stopping = None, None
        if not self.options.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            if self.engine.is_global_zero:
                print(
                    "stratagem: fit() runs outside the main thread, where signals cannot be caught: a "
                    "preemption ends this run without a checkpoint of its step.",
                    file=sys.stderr,
                )
            return
        for name in self.options.signals:
            number = getattr(signal, name)
            # DataLoader worker processes forked from here inherit the handler: they no longer die of the
            # signal (their parent would then fail on their death); they end with their parent.
            self._previous[number] = signal.signal(number, self._catch)
        if self.engine.world_size > 1:
            self._agreement = _agreement.Agreement(self.engine)

    def disarm(self) -> None:
        agreement, self._agreement = self._agreement, None
        if agreement is not None:
            agreement.close()
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)

    def _catch(self, number: int, frame: Any) -> None:
        if self._caught is None:
            self._caught = (number, time.time())

    # agreeing ---------------------------------------------------------------------------------------------
    def agreed(self) -> bool:
        """Whether the ranks stop at this step boundary: a collective, called by every rank at each boundary.

        With several ranks this reads the exchange the previous boundary started, if it started one
        (:mod:`stratagem.trainer._agreement`): a signal is acted on at the same step on every rank, one boundary
        after the first exchange that carries it.
        """
        if not self._previous:
            return False
        if self._agreement is not None:
            return self._decide(self._agreement.exchange(self._local()))
        caught = self._caught
        return caught is not None and self._stop(caught[0], caught[1])

    def settle(self) -> bool:
        """At the end of training (every rank at the same step): whether the ranks stop there, from the exchange
        still in flight or one more (a signal since the last exchange began would otherwise go unseen)."""
        if self._agreement is None or self.stopping is not None:
            return self.stopping is not None
        return self._decide(self._agreement.final(self._local()))

    def _local(self) -> tuple[float, float, float]:
        caught = self._caught
        return (1.0, -caught[1], float(caught[0])) if caught else _agreement.NOTHING

    def _decide(self, reduced: _agreement.Reduced | None) -> bool:
        # max of (caught, -time, signal, step time): any rank, the earliest time, one signal.
        if reduced is None or reduced[0] <= 0:
            return False
        return self._stop(int(reduced[2]), -reduced[1])

    def _stop(self, number: int, received: float) -> bool:
        self.stopping = {"signal": signal.Signals(number).name, "received": received, "stopped": time.time()}
        return True

    def record(self, step: int) -> dict[str, Any] | None:
        """What the checkpoint of the stopping step keeps of the preemption (``None`` for another checkpoint):
        the signal, the step, and when (wall clock) the first rank caught it and this rank stopped."""
        if self.stopping is None:
            return None
        return {**self.stopping, "step": step}

    # stopping ---------------------------------------------------------------------------------------------
    def exit_if_stopped(
        self,
        step: int,
        checkpoint_of: Callable[[int], Path | str],
        notify: Callable[[BaseException], None],
        say: Callable[[str], None],
    ) -> None:
        """Once the ranks agreed and the checkpoint of their ``step`` (at ``checkpoint_of(step)``) is written and
        waited for: ``notify`` the callbacks and loggers (which close their runs), ``say`` what happened, requeue
        a SLURM job, and raise :class:`Preempted` on every rank."""
        if self.stopping is None:
            return
        name = self.stopping["signal"]
        path = str(checkpoint_of(step))
        grace = self.options.grace_s
        took = time.time() - self.stopping["received"]
        message = (
            f"stratagem: preempted by {name} at step {step}: saved {path} {took:.1f} s after the signal (grace "
            f"period {grace:g} s). Exit code {PREEMPTED_EXIT_CODE}: run it again (ckpt_path='last') to continue."
        )
        preempted = Preempted(message, signal=name, step=step, checkpoint=path)
        notify(preempted)  # loggers close their runs, on every rank
        _preemption_signals.write_note(
            {**self.stopping, "step": step, "checkpoint": path, "rank": self.engine.rank}
        )
        say(message)
        if took > grace:
            say(
                f"stratagem: that is more than the grace period of {grace:g} s: a scheduler would have killed the "
                "run before its checkpoint was complete. Ask for a longer one (SLURM: --signal=USR1@SECONDS; "
                "Kubernetes: terminationGracePeriodSeconds), or make steps and checkpoints shorter."
            )
        if self.engine.is_global_zero:
            # Rank 0 has the checkpoint published (every rank's part written) and its loggers closed.
            said = requeue_slurm_job(self.options.slurm_requeue)
            if said:
                say(said)
        # Nobody exits before everyone is done here: a launcher stops the others once one has exited.
        self.engine.barrier("preempted")
        raise preempted


def requeue_slurm_job(mode: bool | None) -> str | None:
    """Requeue the SLURM job this process runs in, as ``Trainer(slurm_requeue=mode)`` says; what to print.

    ``None``: when the job may be requeued (``Requeue=1``: ``sbatch --requeue``, or the cluster's default) and is
    still running: the signal came ahead of the end (``--signal=USR1@90``, ``scancel --signal``). A job that SLURM
    is ending already (``scancel``, its time limit) is left to end: it would otherwise come back after a cancel.
    ``True``: always (a preemption by SIGTERM too; ``scancel`` then requeues the job as well).
    """
    job = cluster.slurm_job()
    if job is None or mode is False:
        return None
    if mode is None:
        shown = _scontrol("show", "job", "-o", job)
        if isinstance(shown, str):
            return f"stratagem: SLURM job {job} not requeued: `scontrol show job` failed ({shown})."
        fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
        if fields.get("Requeue") != "1":
            return f"stratagem: SLURM job {job} not requeued: it was submitted with --no-requeue."
        if fields.get("JobState") != "RUNNING":
            return (
                f"stratagem: SLURM job {job} not requeued: SLURM is ending it already ({fields.get('JobState')}: "
                "scancel, its time limit or a preemption). Submit with --signal=USR1@SECONDS to have it requeue "
                "itself before the end, or pass Trainer(slurm_requeue=True)."
            )
    done = _scontrol("requeue", job)
    if isinstance(done, str) or done.returncode != 0:
        why = done if isinstance(done, str) else (done.stderr or done.stdout).strip()
        return f"stratagem: `scontrol requeue {job}` failed: {why}. Submit the job again to continue."
    return f"stratagem: requeued SLURM job {job}: it resumes from this checkpoint when it starts again."


def _scontrol(*args: str) -> subprocess.CompletedProcess | str:
    try:
        done = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if done.returncode != 0 and args[0] == "show":
        return (done.stderr or done.stdout).strip()
    return done
