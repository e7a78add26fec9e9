"""What the Trainer does about failures: resume a restarted group by itself, save on a wall-clock cadence,
watch for hangs, and say what each restart cost.

- In a restarted worker group, ``fit`` resumes from the newest complete checkpoint of this run (as
  ``ckpt_path="last"`` does), whatever ``ckpt_path`` the script passes.
- ``checkpoint_every_n_minutes``: rank 0 decides when the time has come and every rank learns it through one
  tiny collective per step, so all ranks save at the same step.
- A :class:`~stratagem.launchers._watchdog.Watchdog` per rank turns a hang into a failure naming the rank.
- Each restart is reported on rank 0 when training resumes, counted as the metric ``restarts``, and
  summarised at the end of ``fit``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from stratagem.launchers import _restarts
from stratagem.launchers._watchdog import Watchdog

if TYPE_CHECKING:
    from stratagem.engine import Engine


class Recovery:
    def __init__(
        self, engine: Engine, *, timeout: float, every_n_minutes: float | None, max_restarts: int
    ) -> None:
        self.engine = engine
        self.timeout = timeout
        self.every_n_seconds = None if every_n_minutes is None else every_n_minutes * 60.0
        self.restart_count = _restarts.restart_count()
        self.restarted = self.restart_count > 0
        #: Whether the metrics carry a ``restarts`` column: when restarts are allowed, by us or by torchrun, or
        #: SLURM requeued the job.
        self.counts_restarts = (
            max_restarts > 0 or _restarts.max_restarts() > 0 or _restarts.slurm_requeues() > 0
        )
        self.restarts: list[_restarts.Restart] = []
        self._last_save = time.monotonic()
        self._watchdog: Watchdog | None = None
        self._progress: _restarts.ProgressNote | None = None

    # resuming --------------------------------------------------------------------------------------------
    def ckpt_path(self, requested: Any) -> Any:
        """The checkpoint to start from: the newest complete one of this run after a restart.

        Decided together: a node that joins a running group starts its first attempt, while the others
        restart; all must resume.
        """
        if self.engine.world_size > 1:
            self.restarted = bool(self.engine.all_reduce(torch.tensor(float(self.restarted)), "max").item())
        return "last" if self.restarted else requested

    def resumed(self, step: int, preempted: dict[str, Any] | None = None) -> str | None:
        """Note where a restarted group resumed; the report rank 0 prints (``None`` in a first attempt).
        ``preempted``: the preemption record of the checkpoint it resumed from."""
        if not self.restarted:
            return None
        restart = _restarts.latest_restart(resumed_step=step, preempted=preempted)
        self.restarts.append(restart)
        return "stratagem: " + restart.describe(_restarts.max_restarts())

    def summary(self) -> str | None:
        if not self.restarts:
            return None
        lost = [r.steps_lost for r in self.restarts if r.steps_lost is not None]
        total = f"; {sum(lost)} step(s) lost in all" if lost else ""
        return f"stratagem: this run was restarted {self.restarts[-1].attempt} time(s){total}."

    # the loop ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        engine = self.engine
        self._last_save = time.monotonic()
        self._progress = _restarts.ProgressNote(enabled=engine.is_global_zero)
        store = None
        if engine.world_size > 1:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
        self._watchdog = Watchdog(self.timeout, engine.rank, engine.world_size, store).start()

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def beat(self, step: int, batch: int, phase: str) -> None:
        if self._watchdog is not None:
            self._watchdog.beat(step, batch, phase)

    def step_done(self, step: int) -> None:
        if self._progress is not None:
            self._progress.note(step)

    def saved(self) -> None:
        self._last_save = time.monotonic()

    def save_due(self) -> bool:
        """Whether the wall-clock cadence asks for a checkpoint now: rank 0's clock decides for everyone."""
        if self.every_n_seconds is None:
            return False
        due = self.engine.is_global_zero and time.monotonic() - self._last_save >= self.every_n_seconds
        if self.engine.world_size == 1:
            return due
        # Only rank 0 contributes: the maximum is its decision, known to all ranks at this same step.
        return bool(self.engine.all_reduce(torch.tensor(float(due)), "max").item())
