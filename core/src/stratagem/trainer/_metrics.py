"""Metrics logged with ``Module.log``: kept as tensors between logging steps (no host sync per step), then
reduced across ranks in one collective per reduce op, and written to a CSV file on rank 0."""

from __future__ import annotations

import csv
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    from stratagem.engine import Engine

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
