"""Metrics logged with ``Module.log`` and ``trainer.log``: kept as tensors between logging steps (no host sync
per step), then reduced across ranks in one collective per reduce op, and sent to the loggers on rank 0 (the
CSV file among them)."""

from __future__ import annotations

import contextlib
import csv
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    from stratagem.engine import Engine
    from stratagem.trainer._callbacks_and_loggers import TrainerEvents
    from stratagem.trainer._progress import Console
    from stratagem.trainer._recovery import Recovery
    from stratagem.trainer._run_state import RunState

_REDUCE_OPS = ("mean", "sum", "max", "min")


class MetricStore:
    """Values logged since the last reduction, combined locally by their reduce op."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._ops: dict[str, str] = {}
        self.prog_bar: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._values)

    def add(self, name: str, value: Any, *, reduce: str = "mean", prog_bar: bool = True) -> None:
        if reduce not in _REDUCE_OPS:
            raise ConfigurationError(
                f"log({name!r}, reduce={reduce!r}): use one of {', '.join(_REDUCE_OPS)}."
            )
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigurationError(
                    f"log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log a scalar."
                )
            value = value.detach().reshape(())
        else:
            value = torch.tensor(float(value), dtype=torch.float64)
        previous = self._values.get(name)
        if previous is None:
            self._values[name], self._counts[name], self._ops[name] = value, 1, reduce
        elif reduce in ("mean", "sum"):
            self._values[name] = previous + value
            self._counts[name] += 1
        else:
            self._values[name] = (
                torch.maximum(previous, value) if reduce == "max" else torch.minimum(previous, value)
            )
        if prog_bar:
            self.prog_bar.add(name)

    def reduce(self, engine: Engine) -> dict[str, float]:
        """Combine across ranks and clear. Every rank must call this at the same point with the same names."""
        names = sorted(self._values)
        if engine.world_size > 1:
            _check_same_names(engine, names)
        result: dict[str, float] = {}
        device = engine.device
        for op in _REDUCE_OPS:
            group = [n for n in names if self._ops[n] == op]
            if not group:
                continue
            local = torch.stack(
                [
                    (self._values[n] / self._counts[n] if op == "mean" else self._values[n]).to(
                        device=device, dtype=torch.float64
                    )
                    for n in group
                ]
            )
            reduced = engine.all_reduce(local, op).tolist()
            result.update(zip(group, reduced))
        self._values.clear()
        self._counts.clear()
        self._ops.clear()
        return result


class RunMetrics:
    """One Trainer's metrics: what is logged during training goes to ``train``, during an evaluation to
    ``evaluation``; each is reduced across ranks when the run writes it (a logging step, the end of an
    evaluation) into ``logged`` (``trainer.logged_metrics``) and sent to the loggers."""

    def __init__(
        self, engine: Engine, run: RunState, events: TrainerEvents, recovery: Recovery, console: Console
    ) -> None:
        self._engine, self._run, self._events = engine, run, events
        self._recovery, self._console = recovery, console
        #: The latest reduced values (training and evaluation).
        self.logged: dict[str, float] = {}
        self.train = MetricStore()
        self.evaluation = MetricStore()
        #: Whether the loggers get the values: from the first ``fit`` on (an evaluation before it writes none).
        self.writing = False
        self._evaluating = False
        self._owned_step = False

    def log(self, name: str, value: Any, *, prog_bar: bool, reduce: str) -> None:
        if self._owned_step:
            raise ConfigurationError(
                f"log({name!r}) inside compute_loss or split_batch while strategy {self._engine.strategy_name!r} "
                "runs the step itself: they run on some ranks only (a pipeline's last stage), and logging is "
                "reduced over every rank. Log from a callback's on_train_batch_end (outputs is the loss there)."
            )
        store = self.evaluation if self._evaluating else self.train
        store.add(name, value, reduce=reduce, prog_bar=prog_bar)

    @contextlib.contextmanager
    def strategy_step(self) -> Iterator[None]:
        """While the strategy runs a step itself: ``log`` would run on some ranks only (a pipeline's last
        stage), so it is refused."""
        self._owned_step = True
        try:
            yield
        finally:
            self._owned_step = False

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """While an evaluation runs: what is logged goes to ``evaluation``."""
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False

    def write_train(self) -> None:
        """A logging step: the training values reduced, kept, shown on the bar, sent to the loggers."""
        store = self.train
        if self._recovery.counts_restarts:
            store.add("restarts", self._recovery.restart_count, reduce="max", prog_bar=False)
        shown = set(store.prog_bar)
        values = store.reduce(self._engine)
        self.logged.update(values)
        self.write(values, self._run.position.epoch)
        bar = self._console.bar
        assert bar is not None
        bar.set_metrics({k: v for k, v in values.items() if k in shown})

    def write(self, values: dict[str, float], epoch: int) -> None:
        if self.writing and self._engine.is_global_zero:
            metrics = {"epoch": epoch, **values}
            self._events.call("log_metrics", metrics=metrics, step=self._run.position.step)


def _check_same_names(engine: Engine, names: list[str]) -> None:
    digest = float(zlib.crc32("\0".join(names).encode()))
    agreed = engine.all_reduce(
        torch.tensor([digest, -digest], dtype=torch.float64, device=engine.device), "max"
    )
    if agreed[0].item() != digest or -agreed[1].item() != digest:
        raise ConfigurationError(
            f"Rank {engine.rank} logged {names}, but other ranks logged different names. Log the same metrics "
            "on every rank (they are reduced together)."
        )


class CsvLog:
    """``metrics.csv``: one row per logging step, one column per metric (the header grows as names appear)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []

    def resume_after(self, step: int) -> None:
        """Keep the rows of an earlier run up to ``step`` (later ones belong to a run that is being redone)."""
        if not self.enabled or not self.path.is_file():
            return
        with self.path.open(newline="") as file:
            rows = [
                row
                for row in csv.DictReader(file)
                if row.get("step", "").isdigit() and int(row["step"]) <= step
            ]
        self._rows = [{k: v for k, v in row.items() if v not in ("", None)} for row in rows]
        self._columns = []
        for row in self._rows:
            self._columns += [k for k in row if k not in self._columns]
        self._rewrite()

    def start_fresh(self) -> None:
        if self.enabled:
            self._rows, self._columns = [], []
            self.path.unlink(missing_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        if new or not self.path.is_file():
            self._columns += new
            self._rewrite()
            return
        with self.path.open("a", newline="") as file:
            csv.DictWriter(file, self._columns).writerow(row)

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as file:
            writer = csv.DictWriter(file, self._columns)
            writer.writeheader()
            writer.writerows(self._rows)
